"""Leftovers of killed writes and strangers are swept, nothing a reader uses is."""

from diloco_cli.runtime.syncer.leftovers import LeftoverSweeper, leftovers
from diloco_cli.store.objects import ObjectStore

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
