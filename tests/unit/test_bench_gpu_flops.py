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
