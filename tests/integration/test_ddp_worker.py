"""The data-parallel baseline of the WAN benchmark: two gloo ranks on loopback."""

import pytest

from bench.ddp_launch import launch_local
from bench.ddp_worker import ring_bytes

TINY = [
    "model.kwargs={num_layers: 1, width: 32, num_heads: 2, context: 32}",
    "data.sequence_length=32",
    "training.batch_size=8",
    "training.warmup_steps=2",
    "sync.evaluation_batches=2",
]


def test_two_ranks_train_identically_with_a_bf16_all_reduce():
    result = launch_local(2, 6, overrides=TINY, eval_every=3, timeout=120)

    # every rank ends with the same parameters (digests all-gathered at the end)
    digests = {rank["final_digest"] for rank in result["ranks"]}
    assert len(result["ranks"]) == 2 and len(digests) == 1 and result["final_digests_equal"]
    assert digests != {result["initial_digest"]}

    # the held-out loss fell: step 0, 3 and 6 evaluated by rank 0
    evaluations = result["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 3, 6]
    assert evaluations[-1]["loss"] < evaluations[0]["loss"]
    assert evaluations[-1]["tokens"] == 6 * 2 * 8 * 32 == result["tokens"]

    # per-step timings and the ring model's bytes of a bf16 buffer (+1 element: the stop flag)
    assert result["steps_done"] == 6 and not result["stopped_by_time"]
    for key in ("compute_seconds", "pack_seconds", "comm_seconds", "step_seconds", "loss"):
        assert len(result["per_step"][key]) == 6
    assert all(seconds > 0 for seconds in result["per_step"]["compute_seconds"])
    assert result["settings"]["wire_dtype"] == "bf16"
    assert result["buffer_elements"] == result["parameters"] + 1
    assert result["bytes_per_step_per_rank"] == ring_bytes(result["parameters"] + 1, 2, 2)


def test_a_hierarchical_all_reduce_of_two_groups_trains_as_the_flat_ring_and_sends_less_between_them():
    """Four ranks in two groups (regions): each group reduces onto its leader, the two
    leaders all-reduce, each broadcasts back; the same training as the flat ring (bf16
    sums in another order), and only the leaders' ring crosses between the groups."""
    flat = launch_local(4, 3, overrides=TINY, timeout=120)
    hierarchical = launch_local(4, 3, overrides=TINY, timeout=120, extra_args=["--groups", "2"])
    assert hierarchical["settings"]["all_reduce"] == "hierarchical" and hierarchical["final_digests_equal"]
    assert flat["settings"]["all_reduce"] == "ring" and flat["leader_ring_bytes_per_step"] == 0
    for mine, theirs in zip(hierarchical["per_step"]["loss"], flat["per_step"]["loss"]):
        assert abs(mine - theirs) < 2e-3
    assert hierarchical["evaluations"][-1]["loss"] == pytest.approx(flat["evaluations"][-1]["loss"], abs=2e-3)
    elements = hierarchical["buffer_elements"]
    assert hierarchical["leader_ring_bytes_per_step"] == 2 * ring_bytes(elements, 2, 2) == 2 * 2 * elements
    flat_crossing = 2 * flat["bytes_per_step_per_rank"]  # 2 of the ring's 4 hops cross between the groups
    assert hierarchical["leader_ring_bytes_per_step"] == pytest.approx(2 / 3 * flat_crossing, rel=1e-3)
