"""The GPU benchmark: without CUDA it measures nothing and says so; its measuring code
runs here on the CPU at tiny sizes (``--device cpu --quick``)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU it would run the whole benchmark")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    output = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--output", str(output)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU found" in result.stdout and "nothing measured" in result.stdout
    assert not output.exists()


def test_the_measurements_run_on_the_cpu(tmp_path):
    output = tmp_path / "gpu.json"
    gpu.main(["--device", "cpu", "--quick", "--output", str(output)])
    document = json.loads(output.read_text())
    results = document["results"]
    assert document["benchmark"] == "gpu" and document["settings"]["device"] == "cpu"
    assert results["device"] == "cpu" and results["peak_bf16_TFLOPs"] is None
    assert [row["model"] for row in results["training"]] == ["default gpt 1x32", "llama 64x2"]
    for row in results["training"]:
        assert row["tokens_per_second"] > 0 and row["model_TFLOPs"] > 0 and row["MFU"] is None
        assert row["precision"] == "bf16" and row["steps"] == 3
    assert results["installs_bit_exact"] is True
    assert {row["codec"] for row in results["codec"]} == {"fp32", "bf16", "int8", "int4", "int2", "topk"}
    for row in results["codec"]:
        assert row["same_payload_as_cpu"] and row["same_values_as_cpu"]
        assert row["encode_MBps"] > 0 and row["decode_MBps"] > 0 and 0 < row["payload_MB"] < row["fp32_MB"]


def test_the_whole_gpu_check_runs_on_the_cpu_and_writes_one_document(tmp_path):
    """bench/gpu_check.sh, as a GPU machine runs it, at tiny sizes on the CPU: one process,
    DDP and FSDP2 over gloo with 2 processes, two learners on made-up GPUs 0 and 1."""
    output = tmp_path / "gpu.json"
    result = subprocess.run(
        ["bench/gpu_check.sh", "--device", "cpu", "--quick", "--output", str(output)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "GPU check passed" in result.stdout
    results = json.loads(output.read_text())["results"]
    assert results["passed"] and all(results[part]["ok"] for part in ("single", "ddp", "fsdp", "learners"))
    for parallelism in ("ddp", "fsdp"):
        part = results[parallelism]
        assert part["parallelism"] == parallelism and part["processes"] == 2 and part["backend"] == "gloo"
        assert part["installs_bit_exact"] and part["tokens_per_second"] > 0
        assert [peak["rank"] for peak in part["peak_memory_MB"]] == [0, 1]
    learners = results["learners"]
    assert learners["ran"] and learners["disjoint_given"]
    assert sorted(entry["CUDA_VISIBLE_DEVICES"] for entry in learners["learners"].values()) == ["0", "1"]
