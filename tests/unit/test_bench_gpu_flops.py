"""The GPU benchmark's arithmetic: peak bf16 FLOP/s by device name, and the FLOPs per token
it counts (its runs: tests/integration/test_bench_gpu.py)."""

import pytest
import torch

from bench import gpu


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L4", 121),
        ("NVIDIA L40S", None),
        ("NVIDIA A10G", 125),
        ("NVIDIA GeForce RTX 4090", 165),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_by_device_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = gpu.peak_bf16_flops(torch.device("cuda", 0))
    assert peak == (tflops * 1e12 if tflops else None)
    assert gpu.peak_bf16_flops(torch.device("cpu")) is None


def test_flops_per_token_counts_every_matrix_multiply_and_attention():
    case = gpu.training_cases(quick=True)[1]
    model = case.build()
    shape = gpu.TINY_LLAMA
    d, layers, hidden, vocabulary = (
        shape["hidden_size"],
        shape["num_hidden_layers"],
        shape["intermediate_size"],
        shape["vocab_size"],
    )
    per_layer = 4 * d * d + 3 * d * hidden  # q, k, v, o; gate, up, down
    assert gpu.matmul_parameters(model) == layers * per_layer + d * vocabulary  # the head, not the embedding
    assert (
        gpu.flops_per_token(model, case)
        == 6 * (layers * per_layer + d * vocabulary) + 12 * layers * d * case.sequence_length
    )


def test_the_gpu_check_runs_one_process_per_gpu_and_judges_what_holds_anywhere(tmp_path):
    from bench import gpu_check

    assert "--nproc-per-node=1" in gpu_check.parts("cuda", False, 1, tmp_path)["fsdp"]
    assert "--nproc-per-node=8" in gpu_check.parts("cuda", False, 16, tmp_path)["ddp"]
    assert "--compile" in gpu_check.parts("cuda", False, 4, tmp_path)["fsdp"]
    assert "--gpus" not in gpu_check.parts("cuda", False, 4, tmp_path)["learners"]  # nvidia-smi's
    assert gpu_check.parts("cpu", True, 0, tmp_path)["learners"][-2:] == ["--gpus", "0,1"]
    codec = [{"same_payload_as_cpu": True, "same_values_as_cpu": True}]
    exact = {"installs_bit_exact": True}
    one_gpu = {"ran": False, "refused_in_one_line": True}
    shared = {"ran": True, "disjoint_given": False, "disjoint_in_nvidia_smi": None}
    base = {"single": {**exact, "codec": codec}, "ddp": exact, "fsdp": exact}
    assert gpu_check.verdicts({**base, "learners": one_gpu})
    assert not gpu_check.verdicts({**base, "learners": shared})
    assert not gpu_check.verdicts({**base, "fsdp": {"installs_bit_exact": False}, "learners": one_gpu})
