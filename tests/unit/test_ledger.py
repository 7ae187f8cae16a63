"""The exactly-once ledger and its compaction: a restart reads a bounded number of
objects and restores exactly what the syncer held."""

import torch

from bench.ledger import GrowingHome
from diloco_cli.codec import RunSecret
from diloco_cli.core.ledger import Ledger, PayloadId
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.store.home import CHECKPOINT_EVERY, SyncerHome

P0, P1 = FragmentIndex(0), FragmentIndex(1)


def payload(learner, fragment, sequence):
    return PayloadId(f"r:{learner}/{fragment}/{sequence}", LearnerId(learner), fragment, sequence)


def test_the_ledger_consumes_up_to_the_merged_mark_and_keeps_refusals_above_it():
    ledger = Ledger()
    ledger.record([payload("a", P0, 5)], [payload("a", P0, 3), payload("a", P0, 7), payload("b", P1, 2)])
    assert ledger.consumed(payload("a", P0, 4)) and ledger.consumed(payload("a", P0, 5))
    assert not ledger.consumed(payload("a", P0, 6)) and ledger.consumed(payload("a", P0, 7))
    assert ledger.consumed(payload("b", P1, 2)) and not ledger.consumed(payload("a", P1, 1))
    assert set(ledger.retired) == {"r:a/0/7", "r:b/1/2"}  # 3 is below the mark: not kept
    ledger.record([payload("a", P0, 9)], [])
    assert set(ledger.retired) == {"r:b/1/2"}  # a merge passed 7
    assert Ledger.from_json(ledger.to_json()) == ledger


def assert_same_state(restored, live):
    assert restored.version == live.version and restored.fragment_versions == live.fragment_versions
    assert restored.snapshot_version == live.snapshot_version and restored.merges == live.merges
    assert restored.ledger == live.ledger
    assert [e.version for e in restored.evaluations] == [e.version for e in live.evaluations]
    for fragment, window in live.windows.items():
        assert restored.windows[fragment].versions == window.versions
        assert restored.windows[fragment].oldest_anchorable == window.oldest_anchorable
    for name, tensor in live.theta.items():
        assert torch.equal(restored.theta[name], tensor), name
    for key, tensor in live.optimizer.state_tensors().items():
        assert torch.equal(restored.optimizer.state_tensors()[key], tensor), key
    for key, tensor in live.publisher.carry_tensors().items():
        assert torch.equal(restored.publisher.carry_tensors()[key], tensor), key


def test_a_compacted_home_restores_exactly_and_reads_the_same_objects_however_long_the_run(tmp_path):
    secret = RunSecret(bytes(range(32)))
    history = GrowingHome(f"file://{tmp_path}/home", secret)
    history.grow(2 * CHECKPOINT_EVERY + 13)
    restored, home = history.restore()
    assert_same_state(restored, history.state)
    first_requests = home.store.meter.snapshot().requests
    # the whole history is still there for audits, each version once, oldest first
    records = SyncerHome(f"file://{tmp_path}/home", None, secret).history()
    assert [r.version for r in records] == list(range(1, 2 * CHECKPOINT_EVERY + 14))
    merged = [m.key for r in records for m in r.merged]
    assert len(merged) == len(set(merged)) and all(restored.ledger.consumed(payload_of(key)) for key in merged)
    # ...but what a restart lists and reads is bounded
    keys = home.store.list("")
    assert [k for k in keys if k.startswith("ledger/")] == ["ledger/0000000050.dlc", "ledger/0000000100.dlc"]
    assert len([k for k in keys if k.endswith(".ready") and k.startswith("commits/")]) == CHECKPOINT_EVERY + 13
    history.grow(2 * CHECKPOINT_EVERY)  # same place between checkpoints, twice the history
    restored, home = history.restore()
    assert_same_state(restored, history.state)
    assert home.store.meter.snapshot().requests == first_requests


def payload_of(key):
    learner, rest = key.split("payloads/", 1)[1].split("/")
    fragment, sequence = rest.removesuffix(".dlc").split("-")
    return PayloadId(key, LearnerId(learner), FragmentIndex(int(fragment)), int(sequence))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    secret = RunSecret(bytes(range(32)))
    history = GrowingHome(f"file://{tmp_path}/home", secret)
    history.grow(2 * CHECKPOINT_EVERY + 7)
    newest = tmp_path / "home" / "ledger" / "0000000100.dlc"
    data = bytearray(newest.read_bytes())
    data[60] ^= 1
    newest.write_bytes(bytes(data))
    restored, _ = history.restore()
    assert_same_state(restored, history.state)
