"""A region's bucket wiped and recreated under a running syncer and reducer (issue 31):
the syncer gives the region back the present, the updates its holders need and the
head; the reducer voids its aggregates that vanished and writes its epoch again; and
an aggregate that holds only sends to resync never holds up the end of the run."""

import shutil
import time
from pathlib import Path

from diloco_cli.core.decisions import updates_to_restore
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.store import aggregates
from diloco_cli.store.documents import LearnerState
from tests.support.harness import Harness


def wipe(harness: Harness) -> None:
    root = Path(harness.spec.regions[0].root.removeprefix("file://"))
    shutil.rmtree(root)
    root.mkdir()


def merge_two_rounds(harness: Harness) -> None:
    """Both learners train 10 steps and merge, twice."""
    writer, reader = harness.learners
    for _ in range(2):
        harness.train(writer, 10)
        harness.train(reader, 10)
        harness.merge()


def test_a_wiped_region_needs_the_updates_after_its_oldest_holder_and_those_its_head_lists():
    windows = {FragmentIndex(0): [Version(2), Version(4), Version(6)], FragmentIndex(1): [Version(3), Version(5)]}
    listed = [(Version(6), FragmentIndex(0))]
    bases = {FragmentIndex(0): [Version(4), Version(6)]}  # fragment 1's holders are not known: its whole window
    assert updates_to_restore(windows, listed, bases) == [(3, 1), (5, 1), (6, 0)]


def test_a_wiped_region_is_given_back_what_it_lost_and_its_sends_merge_again(tmp_path, secret):
    harness = Harness(tmp_path, secret, quorum=2)
    try:
        writer, reader = harness.learners
        for _ in range(3):
            harness.train(writer, 10)
            harness.train(reader, 10)
            harness.merge()
        harness.train(writer, 10)
        harness.train(reader, 10)
        harness.reducer.turn(read_heartbeats=True)  # forwarded; the wipe takes these aggregates
        assert harness.reducer.in_flight
        syncer, bucket = harness.syncer, harness.bucket
        wipe(harness)
        bucket.write_head(syncer.head())  # as a publication right after the wipe does: the updates stay gone
        syncer.turn(read_heartbeats=True)
        head = bucket.read_head()
        assert head is not None and head.version == syncer.state.version
        assert head.version in bucket.snapshot_versions()  # the region's copy can start from the present
        window = {(v, p) for p, w in syncer.state.windows.items() for v in w.versions}
        bases = {p: v for learner in harness.learners for p, v in learner.fragments.base_version.items()}
        assert {(v, p) for v, p in window if v > bases[p]} <= set(bucket.update_versions())
        harness.reducer.turn(read_heartbeats=True)
        assert not harness.reducer.in_flight and harness.reducer.counts["voided"] >= 1
        assert bucket.read_epoch(bucket.layout.reducer_name) == harness.reducer.aggregation.epoch
        before = syncer.state.version
        for _ in range(2):  # the learners' next sends (from their old bases) are anchored and merged
            harness.train(writer, 10)
            harness.train(reader, 10)
            harness.merge()
        assert syncer.state.version >= before + 2
        merged = {m.learner for c in syncer.home.history() if c.version > before for m in c.merged}
        assert merged == {"east-0", "east-1"}
        for learner in harness.learners:
            harness.poll(learner)
            harness.assert_bases_equal_the_syncers(learner)
    finally:
        harness.close()


def test_an_aggregate_of_sends_to_resync_alone_does_not_hold_up_the_end(tmp_path, secret):
    """K=M, the reader gone a while: a send of it from a base the reducer's window no
    longer holds makes an aggregate with no send to merge: the syncer tells its learner at
    sight, so the reducer's status does not count it in flight, and a finished head
    resolves it."""
    harness = Harness(tmp_path, secret, quorum=2, window_versions=1)
    try:
        writer, reader = harness.learners
        store = harness.bucket.store
        harness.train(reader, 10)  # from base 0, held back while the writer moves on
        slow = {key: store.get(key) for key in store.list("payloads/east-1")}
        for key in slow:
            store.delete(key)
        reader.heartbeats.beat(LearnerState.STOPPED, wait=10)  # the quorum is lowered to the writer
        while min(harness.syncer.state.fragment_versions.values()) < 3:
            harness.train(writer, 10)
            harness.merge()
        for key, data in slow.items():
            store.put(key, data)
        writer.heartbeats.beat(LearnerState.FINISHED, wait=10)  # nobody left to wait for: it goes alone
        reducer = harness.reducer
        reducer.turn(read_heartbeats=True)
        alone = [r for r in reducer.in_flight.values() if not r.sends]
        assert alone and all(s.learner == "east-1" for r in alone for s in r.resync)
        assert reducer.status().in_flight == {}
        finish_both(harness)
        assert aggregates.aggregate_keys(harness.bucket) == []
    finally:
        harness.close()


def test_a_relayed_send_to_resync_goes_at_once_and_does_not_hold_up_the_end(tmp_path, secret):
    """K=1: a send relayed from a base the syncer's window no longer holds: its learner is
    told to resync and the relay is deleted at once (not at a later commit, which may never
    come), so its reducer lets the send go and the run ends."""
    harness = Harness(tmp_path, secret, window_versions=1)
    try:
        writer, reader = harness.learners
        store = harness.bucket.store
        harness.train(reader, 10)  # from base 0, held back while the writer moves on
        slow = {key: store.get(key) for key in store.list("payloads/east-1")}
        for key in slow:
            store.delete(key)
        while min(harness.syncer.state.fragment_versions.values()) < 3:
            harness.train(writer, 10)
            harness.merge()
        for key, data in slow.items():
            store.put(key, data)
        reducer, syncer = harness.reducer, harness.syncer
        reducer.turn(read_heartbeats=True)
        assert {r.learner for r in reducer.relayed.values()} == {"east-1"}
        syncer.turn(read_heartbeats=True)
        assert not harness.bucket.relay_keys()  # retired and deleted before any commit lists it
        assert harness.bucket.read_control("east-1").resync_serial >= 1  # told to resync
        reducer.turn(read_heartbeats=True)
        assert not reducer.relayed and not harness.bucket.payload_keys()
        finish_both(harness)
    finally:
        harness.close()


def finish_both(harness: Harness) -> None:
    """Both learners finish; the syncer and the reducer turn until both are done."""
    reducer = harness.reducer
    for learner in harness.learners:
        learner.heartbeats.beat(LearnerState.FINISHED, wait=10)
    for _ in range(40):
        reducer.turn(read_heartbeats=True)
        if not harness.syncer.finished:
            harness.syncer.turn(read_heartbeats=True)
        if harness.syncer.finished and reducer.finished:
            break
        time.sleep(0.1)
    assert harness.syncer.finished and reducer.finished


def test_a_reducer_that_still_reports_sends_is_waited_for_give_up_seconds_and_shown_meanwhile(tmp_path, secret):
    """Every learner done, nothing left to merge, but the region's reducer last reported
    an aggregate in flight (it died, or its bucket was wiped): the run is not held for
    ever; it ends after ``give_up_seconds``, and ``diloco status`` says why meanwhile."""
    from diloco_cli.store.documents import SyncerPhase
    from diloco_cli.views.run_state import collect_status

    harness = Harness(tmp_path, secret, quorum=2, give_up_seconds=3.0)
    try:
        writer, reader = harness.learners
        harness.train(writer, 10)
        harness.train(reader, 10)
        reducer, syncer = harness.reducer, harness.syncer
        reducer.turn(read_heartbeats=True)
        assert reducer.in_flight
        aggregates.write_reducer_status(harness.bucket, reducer.status())  # its last word: then it is gone
        for learner in harness.learners:
            learner.heartbeats.beat(LearnerState.FINISHED, wait=10)
        started, shown = time.monotonic(), None
        while not syncer.finished and time.monotonic() - started < 30:
            syncer.turn(read_heartbeats=True)
            if getattr(syncer, "ending", None) and shown is None:
                syncer.write_status(SyncerPhase.RUNNING)
                shown = collect_status(harness.spec).problems
            time.sleep(0.2)
        assert syncer.finished, "the run waited for the reducer for ever"
        assert shown and any("reducer of region east" in line for line in shown), shown
    finally:
        harness.close()


def test_a_reducer_restarted_in_a_wiped_region_numbers_its_aggregates_above_those_merged(tmp_path, secret):
    """Its epoch record went with the bucket: a restart must not number its aggregates as
    the first start did (the syncer would take them for ones it consumed, and wait)."""
    from diloco_cli.runtime.reducer.loop import Reducer

    harness = Harness(tmp_path, secret, quorum=2)
    try:
        merge_two_rounds(harness)
        wipe(harness)
        harness.syncer.turn(read_heartbeats=True)
        harness.reducer = Reducer(harness.spec, "east", secret)
        harness.reducer.start()
        before = harness.syncer.state.version
        merge_two_rounds(harness)
        assert harness.reducer.aggregation.epoch == 2
        merged = {m.learner for c in harness.syncer.home.history() if c.version > before for m in c.merged}
        assert merged == {"east-0", "east-1"}
    finally:
        harness.close()


def test_a_syncer_restarted_after_its_region_was_wiped_restores_it_rather_than_catch_it_up(tmp_path, secret):
    """A start's catch-up writes the head and its recent updates only: a wiped region
    would look whole without its snapshot and window, so it is restored at the first look."""
    from diloco_cli.runtime.syncer.loop import Syncer

    harness = Harness(tmp_path, secret)
    try:
        merge_two_rounds(harness)
        wipe(harness)
        restarted = Syncer(harness.spec, secret)
        restarted.start()
        restarted.turn(read_heartbeats=True)
        restarted.fanout.close()
        assert restarted.state.version in harness.bucket.snapshot_versions()
    finally:
        harness.close()
