"""The whole GPU check, in under 10 minutes on one GPU, into ``bench/results/gpu.json``.

``bench/gpu_check.sh`` runs it; each part is a benchmark of its own, run here in a fresh
process with a time limit, its JSON gathered into one document:

1. ``bench.gpu``: one process, tokens/s and MFU of the default model and a 134M Llama,
   eager and compiled; installs bit-exact on the device; the codec on device tensors;
2. ``bench.gpu_distributed`` under torchrun, one process per GPU (at most 8), DDP then
   FSDP2, compiled: tokens/s and MFU of the Llama recipe (``recipes/llama-small.yaml``:
   its model, batch, micro-batch and context), each rank's peak memory, installs
   bit-exact through the gathers and scatters;
3. ``bench.gpu_learners``: two learners of a run on this host, each on a GPU of its own
   (with one GPU: refused in one line instead).

With one GPU, part 2 runs one process (NCCL refuses two ranks on one device), so its
FSDP2 peak is the whole model's; with N GPUs, each rank's peak shows the 1/N share.
``--device cpu --quick`` runs every part at tiny sizes on the CPU (gloo, 2 processes,
made-up GPUs 0 and 1 for the learners): what the tests run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import benchmark_parser, write_and_report

REPOSITORY = Path(__file__).resolve().parents[1]
TIME_LIMITS = {"single": 240, "ddp": 120, "fsdp": 120, "learners": 150}
"""Seconds each part may take: 630 s in all, though together they take about half that."""
MAX_PROCESSES = 8


def parts(device: str, quick: bool, gpus: int, work: Path) -> dict[str, list[str]]:
    """The command of every part, each writing its JSON into ``work``."""
    quick_flag = ["--quick"] if quick else []
    processes = 2 if device == "cpu" else max(1, min(gpus, MAX_PROCESSES))
    python = sys.executable
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    distributed = [*torchrun, "-m", "bench.gpu_distributed", "--device", device, *quick_flag]
    compiled = [] if device == "cpu" else ["--compile"]  # inductor takes minutes on a CPU
    return {
        "single": [python, "-m", "bench.gpu", "--device", device, "--steps", "100", *quick_flag],
        "ddp": [*distributed, "--parallelism", "ddp", *compiled],
        "fsdp": [*distributed, "--parallelism", "fsdp", *compiled],
        "learners": [python, "-m", "bench.gpu_learners", *quick_flag, *(["--gpus", "0,1"] if device == "cpu" else [])],
    }


def run_part(name: str, command: list[str], output: Path) -> dict[str, Any]:
    """One part in its own process: its results, or what went wrong."""
    started = time.perf_counter()
    try:
        finished = subprocess.run(
            [*command, "--output", str(output)],
            cwd=REPOSITORY,
            capture_output=True,
            text=True,
            timeout=TIME_LIMITS[name],
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"took longer than {TIME_LIMITS[name]} s", "seconds": TIME_LIMITS[name]}
    seconds = time.perf_counter() - started
    if finished.returncode != 0 or not output.exists():
        tail = (finished.stdout + finished.stderr).strip().splitlines()[-60:]
        return {"ok": False, "error": f"exit {finished.returncode}", "output": tail, "seconds": seconds}
    return {"ok": True, "seconds": seconds, **json.loads(output.read_text())["results"]}


def check(device: str, quick: bool) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    results: dict[str, Any] = {"gpus": gpus}
    with tempfile.TemporaryDirectory(prefix="diloco-gpu-check-") as work:
        for name, command in parts(device, quick, gpus, Path(work)).items():
            print(f"{name}: {' '.join(command[1:])}", flush=True)
            results[name] = run_part(name, command, Path(work) / f"{name}.json")
            state = "ok" if results[name]["ok"] else f"FAILED ({results[name]['error']})"
            print(f"  {state} in {results[name]['seconds']:.0f} s", flush=True)
    results["passed"] = all(results[name]["ok"] for name in TIME_LIMITS) and verdicts(results)
    return results


def verdicts(results: dict[str, Any]) -> bool:
    """What must hold on any machine: exact installs everywhere, and learners on GPUs of
    their own (or, with one GPU, refused in one line)."""
    single, learners = results["single"], results["learners"]
    exact = single["installs_bit_exact"] and all(results[p]["installs_bit_exact"] for p in ("ddp", "fsdp"))
    same_codec = all(row["same_payload_as_cpu"] and row["same_values_as_cpu"] for row in single["codec"])
    if learners["ran"]:
        own_gpus = learners["disjoint_given"] and learners["disjoint_in_nvidia_smi"] in (True, None)
    else:
        own_gpus = learners["refused_in_one_line"]
    return bool(exact and same_codec and own_gpus)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = benchmark_parser(__doc__, "every part at tiny sizes (with --device cpu: what the tests run)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU found: nothing measured; `bench/gpu_check.sh --device cpu --quick` checks the steps here")
        return None
    started = time.perf_counter()
    results = check(args.device, args.quick)
    results["total_seconds"] = time.perf_counter() - started
    write_and_report("gpu", args, {"device": args.device, "time_limits": TIME_LIMITS}, results)
    print(f"GPU check {'passed' if results['passed'] else 'FAILED'} in {results['total_seconds']:.0f} s")
    if not results["passed"]:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
