"""Leftovers of killed writes and strangers are swept, nothing a reader uses is."""

from diloco_cli.runtime.syncer.leftovers import LeftoverSweeper, leftovers
from diloco_cli.store.objects import MARKER_SUFFIX, ObjectStore
from diloco_cli.store.region import MARKED_KEYS
from tests.support.harness import Harness

KEPT = [
    "manifest.json",
    "payloads/east-0/000-000001000001.dlc",
    "payloads/east-0/000-000001000001.dlc.ready",
    "checkpoints/east-0/0000000100.dlc",
    "checkpoints/east-0/0000000100.dlc.ready",
    "global/updates/0000000007-001.dlc",
    "global/updates/0000000007-001.dlc.ready",
    "global/snapshots/0000000000.dlc",
    "global/snapshots/0000000000.dlc.ready",
    "global/head.json",
    "global/syncer.json",
    "aggregates/001-000001000003.dlc",
    "aggregates/001-000001000003.dlc.ready",
    "reducer/residuals/001-000001000003.dlc",
    "reducer/residuals/001-000001000003.dlc.ready",
    "reducer/status.json",
    "reducer/shard-1/status.json",
    "heartbeats/east-0.json",
    "control/east-0.json",
    "control/east-0.epoch",
    "notes/mine.txt",  # outside the prefixes diloco owns: never touched
]
LEFT = [
    "payloads/east-0/000-000001000002.dlc",  # an upload killed before its marker
    "payloads/east-0/000-000001000003.dlc.9f2c.partial",  # a local write killed midway
    "checkpoints/east-0/0000000200.dlc",  # a checkpoint without its marker
    "global/updates/0000000008-000.dlc.ready",  # a marker whose object was removed
    "payloads/east-0/stray.bin",  # junk among the run's objects
    "global/old-head.json",
    "aggregates/000-000001000004.dlc",  # a reducer killed before the aggregate's marker
    "reducer/residuals/000-000001000002.dlc.ready",  # a residual dropped, its marker not yet
    "reducer/notes.txt",
]


def test_leftovers_are_exactly_what_no_reader_uses():
    assert sorted(leftovers(sorted(KEPT + LEFT))) == sorted(LEFT)


def test_the_sweeper_waits_until_a_leftover_is_older_than_any_write_in_flight(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/bucket")
    for key in KEPT:
        store.put(key, b"x")
    for key in LEFT[:1] + LEFT[2:]:
        store.put(key, b"x")
    (tmp_path / "bucket" / LEFT[1]).write_bytes(b"half")
    sweeper = LeftoverSweeper(store, after_seconds=60)
    sweeper.sweep(now=1000.0)
    assert sweeper.removed == 0  # first seen now: an upload may still be finishing
    store.put(LEFT[0] + ".ready", b"marker")  # ...and this one was: it is whole now
    sweeper.sweep(now=1059.0)
    assert sweeper.removed == 0
    sweeper.sweep(now=1060.0)
    assert sweeper.removed == len(LEFT) - 1
    remaining = store.list("", include_partial=True)
    assert remaining == sorted(KEPT + [LEFT[0] + ".ready", LEFT[0]])


def test_the_marker_of_a_live_aggregate_or_residual_is_no_leftover():
    """Issue 31: the sweeper knew payloads, checkpoints, updates and snapshots, not the
    reducers' aggregates and residuals, and swept their markers while they were live."""
    for key in ("aggregates/000-000001000001.dlc", "reducer/residuals/002-000002000007.dlc"):
        assert leftovers([key, key + MARKER_SUFFIX]) == []
        assert leftovers([key]) == [key] and leftovers([key + MARKER_SUFFIX]) == [key + MARKER_SUFFIX]


def test_every_kind_a_run_writes_with_a_marker_is_known_to_the_sweeper(tmp_path, secret):
    """Whatever runs with reducers, syncer shards and checkpoints write marked (payloads,
    checkpoints, updates, snapshots, aggregates in flight and residuals under K=M, relays
    under K<M), the sweeper keeps."""
    keys = []
    for quorum in (2, 1):
        harness = Harness(tmp_path / f"k{quorum}", secret, shards=2, num_fragments=4, checkpoint_every=5, quorum=quorum)
        try:
            writer, reader = harness.learners
            for learner in (writer, reader):
                harness.train(learner, 10)
            harness.merge()
            for learner in (writer, reader):
                harness.train(learner, 10)
            for reducer in harness.reducers:
                reducer.turn(read_heartbeats=True)  # forwards what the syncers have not merged yet
            keys += harness.bucket.store.list("", include_partial=True)
        finally:
            harness.close()
    marked = [key[: -len(MARKER_SUFFIX)] for key in keys if key.endswith(MARKER_SUFFIX)]
    kinds = {pattern.pattern for key in marked for pattern in MARKED_KEYS if pattern.match(key)}
    assert kinds == {pattern.pattern for pattern in MARKED_KEYS}  # the runs wrote every kind
    assert all(any(pattern.match(key) for pattern in MARKED_KEYS) for key in marked)
    assert leftovers(keys) == []


def test_the_sweep_at_the_end_spares_a_partial_write_first_seen_then(tmp_path):
    """The sweep when a run ends removes every leftover at once, but another syncer shard
    or a reducer may still be writing its last status: a ``.partial`` file first seen
    then is a write in flight (removed under it, the rename crashed syncer shard 1 of a
    chaos run), one seen at an earlier sweep is not."""
    store = ObjectStore(f"file://{tmp_path}/bucket")
    (tmp_path / "bucket" / "global").mkdir(parents=True)
    old = tmp_path / "bucket" / "global" / "head.json.0a1b.partial"
    old.write_bytes(b"killed")
    sweeper = LeftoverSweeper(store, after_seconds=60)
    sweeper.sweep(now=1000.0)
    in_flight = tmp_path / "bucket" / "global" / "shard-1" / "syncer.json.9f2c.partial"
    in_flight.parent.mkdir()
    in_flight.write_bytes(b"half")
    store.put("payloads/east-0/stray.bin", b"junk")
    sweeper.sweep(now=1001.0, all_of_them=True)
    assert not old.exists() and in_flight.exists() and store.list("payloads") == []
