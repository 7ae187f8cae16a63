"""Hostile and damaged objects, driven step by step: a real syncer and real learners in
this process over file:// buckets, with the bucket tampered with between their steps.

Forged, replayed and reordered global objects are refused, counted and shown; a damaged
update or snapshot falls back (to a snapshot, or an older one) and is rewritten by the
syncer from its commits; a damaged checkpoint falls back to an older one, then to the
global weights keeping the step count.  After every install the learner's bases equal
the syncer's weights bit for bit.
"""

from diloco_cli.codec import RunSecret
from diloco_cli.core.types import FragmentIndex
from diloco_cli.runtime.syncer.loop import Syncer
from diloco_cli.store.documents import SyncerPhase, seal
from diloco_cli.store.region import HEAD_KEY, heartbeat_key, snapshot_key, update_key
from diloco_cli.views.run_state import collect_status
from tests.support.harness import Harness


def flip_a_byte(bucket, key, position=-40):
    data = bytearray(bucket.store.get(key))
    data[position] ^= 0x10
    bucket.store.put(key, bytes(data))


def test_forged_replayed_and_reordered_objects_are_refused_counted_and_shown(harness):
    writer, reader = harness.learners
    for _ in range(2):
        harness.train(writer, 10)
        harness.merge()
    assert harness.poll(reader)
    harness.assert_bases_equal_the_syncers(reader)
    old_head = harness.bucket.store.get(HEAD_KEY)
    harness.train(writer, 10)
    harness.merge()
    assert harness.poll(reader)
    harness.assert_bases_equal_the_syncers(reader)

    # a head sealed with another key: refused, nothing installed
    head = harness.bucket.read_head()
    forged = head.model_copy(update={"version": head.version + 5})
    harness.bucket.store.put(HEAD_KEY, seal(forged, HEAD_KEY, RunSecret(bytes(32))))
    harness.train(writer, 10)
    harness.merge()  # the syncer publishes again, over the forgery; forge it once more
    harness.bucket.store.put(HEAD_KEY, seal(forged, HEAD_KEY, RunSecret(bytes(32))))
    assert not harness.poll(reader)
    assert reader.refusals.counts["head"] == 1 and "tag mismatch" in reader.refusals.latest.reason

    # an authentic but older head (a replay): refused, nothing installed
    harness.bucket.store.put(HEAD_KEY, old_head)
    assert not harness.poll(reader)
    assert reader.refusals.counts["head"] == 2 and "replayed head" in reader.refusals.latest.reason

    # an update copied over a later one of the same fragment: its authenticated
    # metadata names another version, so the chain is refused (and so is the
    # snapshot path, which needs the same update)
    for _ in range(2):  # the region's reducer follows an authentic head again (it held the sends meanwhile)
        harness.train(writer, 10)
        harness.merge()  # the syncer's head is authentic again, two versions of each fragment on
    head = harness.bucket.read_head()
    fragment = FragmentIndex(1)
    newest, earlier = sorted(
        (v for v, p in head.recent if p == fragment and v > reader.fragments.base_version[p]), reverse=True
    )[:2]
    good = harness.bucket.store.get(update_key(newest, fragment))
    harness.bucket.store.put(update_key(newest, fragment), harness.bucket.store.get(update_key(earlier, fragment)))
    installed = harness.poll(reader)
    assert fragment not in installed
    assert reader.refusals.counts["update"] >= 1 and f"not {earlier} to {newest}" in str(
        [n.reason for n in reader.refusals.recent]
    )
    # once the object is whole again, the reader catches up, bit for bit
    harness.bucket.store.put(update_key(newest, fragment), good)
    harness.poll(reader)
    harness.assert_bases_equal_the_syncers(reader)
    # the refusals reach the heartbeat, which status shows
    reader.heartbeats.beat(wait=10)
    from diloco_cli.views.run_state import collect_status

    region = collect_status(harness.spec, harness.secret).regions[0]
    by_reducer = harness.reducer.refusals.counts.get("head", 0)  # the region's reducer met the forged head too
    assert by_reducer >= 1 and region.refusals["head"] == 2 + by_reducer and region.refusals["update"] >= 1


def test_a_damaged_update_is_rewritten_by_the_syncer_and_installs_resume(harness):
    writer, reader = harness.learners
    harness.train(writer, 10)
    harness.merge()
    harness.poll(reader)
    for _ in range(2):
        harness.train(writer, 10)
        harness.merge()
    head = harness.bucket.read_head()
    needed = [(v, p) for v, p in head.recent if v > reader.fragments.base_version[p]]
    version, fragment = needed[-1]
    flip_a_byte(harness.bucket, update_key(version, fragment))
    flip_a_byte(harness.bucket, snapshot_key(head.snapshot_version))
    installed = harness.poll(reader)
    assert fragment not in installed
    assert reader.refusals.counts.get("update", 0) >= 1
    # the reader reports it in its heartbeat; the syncer checks the object and rewrites it
    reader.heartbeats.beat(wait=10)
    harness.syncer.turn(read_heartbeats=True)
    assert harness.syncer.publication.repairs >= 1
    assert harness.bucket.store.get(update_key(version, fragment)) == harness.syncer.home.read_update(version)
    assert fragment in harness.poll(reader)
    harness.assert_bases_equal_the_syncers(reader)


def test_a_learner_restarted_with_every_snapshot_damaged_waits_for_the_repair_instead_of_crashing(harness):
    writer, _ = harness.learners
    for _ in range(3):
        harness.train(writer, 10)
        harness.merge()
    for version in harness.bucket.snapshot_versions():
        flip_a_byte(harness.bucket, snapshot_key(version))
    newcomer = harness.learner("east-1", start=False)  # no checkpoint: needs a snapshot
    try:
        assert not harness.poll(newcomer)
        assert newcomer.refusals.counts["snapshot"] >= 1 and not newcomer.fragments.installed
        newcomer.heartbeats.beat(wait=10)
        harness.reducer.turn(read_heartbeats=True)  # the region's reducer writes a snapshot of its copy again
        newest = max(harness.bucket.snapshot_versions())
        assert newest == harness.reducer.replica.version and harness.bucket.read_snapshot(newest)
        assert len(harness.poll(newcomer)) == 2
        harness.assert_bases_equal_the_syncers(newcomer)
    finally:
        newcomer.close()


def test_a_snapshot_its_clean_up_removed_while_a_learner_read_it_is_not_counted_as_refused(harness):
    """A newcomer reads the head, then the syncer moves on and its clean-up removes the
    snapshot that head named before the newcomer gets to it: the snapshot vanished, it
    was not damaged; nothing is refused (nor reported for repair), and the next look
    installs from the newer snapshot."""
    writer, _ = harness.learners
    for _ in range(2):
        harness.train(writer, 10)
        harness.merge()
    newcomer = harness.learner("east-1", start=False)  # no checkpoint: needs a snapshot
    try:
        reader = newcomer.poller.readers[0]
        head = reader.head()
        while head.snapshot_version in harness.bucket.snapshot_versions():
            harness.train(writer, 10)
            harness.merge()
        fetched = reader.fetch(head, {p: -1 for p in newcomer.fragments.base_version})
        assert fetched.refusals == [] and fetched.fragments == []
        assert len(harness.poll(newcomer)) == 2
        assert newcomer.refusals.counts == {}
        harness.assert_bases_equal_the_syncers(newcomer)
    finally:
        newcomer.close()


def test_a_damaged_checkpoint_falls_back_to_an_older_one_then_to_the_global_weights_keeping_the_step(tmp_path, secret):
    harness = Harness(tmp_path, secret, checkpoint_every=10)
    try:
        learner = harness.learners[0]
        harness.train(learner, 25)
        assert learner.checkpoints.flush(10)
        keys = harness.bucket.checkpoint_keys("east-0")
        assert [key.rsplit("/", 1)[1] for key in keys] == ["0000000010.dlc", "0000000020.dlc"]
        flip_a_byte(harness.bucket, keys[-1])
        restarted = harness.learner("east-0")
        assert restarted.progress.step == 10 and restarted.refusals.counts["checkpoint"] == 1
        assert harness.bucket.checkpoint_keys("east-0") == keys[:1]  # the damaged one is gone for good
        harness.learners.append(restarted)
        harness.train(restarted, 15)  # checkpoints at 20 again
        assert restarted.checkpoints.flush(10)
        for key in harness.bucket.checkpoint_keys("east-0"):
            flip_a_byte(harness.bucket, key)
        again = harness.learner("east-0")
        harness.learners.append(again)
        # nothing verifies: the global weights, at the step the checkpoints had reached
        assert again.progress.step == 20 and again.progress.tokens == 20 * again.tokens_per_step
        assert again.fragments.installed and again.refusals.counts["checkpoint"] == 3
        harness.assert_bases_equal_the_syncers(again)
    finally:
        harness.close()


def test_evaluations_are_committed_with_their_version_and_survive_a_restart(harness):
    writer, _ = harness.learners
    for _ in range(4):
        harness.train(writer, 10)
        harness.merge()
    evaluated = [e.version for e in harness.syncer.state.evaluations]
    assert evaluated[0] == 0 and all(v % 2 == 0 for v in evaluated) and len(evaluated) >= 3
    restarted = Syncer(harness.spec, harness.secret)
    restarted.start()  # killed right after its last commit: nothing to redo
    assert [e.version for e in restarted.state.evaluations] == evaluated
    assert [e.loss for e in restarted.state.evaluations] == [e.loss for e in harness.syncer.state.evaluations]


def test_a_restarted_syncer_continues_its_refusals_repairs_and_sweeps(harness):
    """Issue 31, point 5: a syncer shard's refusals vanished from `status` after a
    SIGKILL; they continue across restarts, as its storage counts do."""
    writer, reader = harness.learners
    harness.train(writer, 10)
    harness.merge()
    harness.poll(reader)
    harness.train(writer, 10)
    harness.merge()
    head = harness.bucket.read_head()
    version, fragment = next((v, p) for v, p in head.recent if v > reader.fragments.base_version[p])
    flip_a_byte(harness.bucket, update_key(version, fragment))
    flip_a_byte(harness.bucket, snapshot_key(head.snapshot_version))
    harness.poll(reader)
    reader.heartbeats.beat(wait=10)
    beat = harness.bucket.read_heartbeat(writer.me.id)
    harness.bucket.store.put(heartbeat_key(writer.me.id), seal(beat, heartbeat_key(writer.me.id), RunSecret(bytes(32))))
    harness.bucket.store.put("payloads/east-0/stray.bin", b"junk")
    syncer = harness.syncer
    syncer.turn(read_heartbeats=True)  # refuses the forged heartbeat, repairs the update
    syncer.sweep(syncer.clock(), all_of_them=True)
    writer.heartbeats.beat(wait=10)  # an authentic heartbeat again: the next start refuses nothing
    syncer.write_status(SyncerPhase.RUNNING)
    before = syncer.status(SyncerPhase.RUNNING)
    assert before.refusals["east"].counts == {"heartbeat": 1}
    assert before.repairs >= 1 and before.leftovers_removed == 1

    restarted = Syncer(harness.spec, harness.secret)  # the first one was "killed" after its status
    restarted.start()
    after = restarted.status(SyncerPhase.RUNNING)
    assert after.refusals["east"].counts == before.refusals["east"].counts
    assert after.refusals["east"].latest == before.refusals["east"].latest
    assert (after.repairs, after.leftovers_removed) == (before.repairs, before.leftovers_removed)
    restarted.write_status(SyncerPhase.RUNNING)
    region = collect_status(harness.spec, harness.secret).regions[0]
    assert region.refusals.get("heartbeat") == 1
