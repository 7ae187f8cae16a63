"""The data-parallel baseline of the WAN benchmark: two gloo ranks on loopback."""

from bench.ddp_worker import launch_local, ring_bytes

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
