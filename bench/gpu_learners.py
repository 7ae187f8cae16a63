"""Benchmark check: two learners on one GPU host, each on GPUs of its own.

``diloco up`` with a tiny Llama on the built-in corpus (``training.device: auto``: CUDA
where there is one) and one local region of two learners.  While they train, each
learner's process is found with the GPUs it was given (``CUDA_VISIBLE_DEVICES`` in its
environment) and, on a GPU machine, the GPU ``nvidia-smi`` shows it computing on; the
run is then awaited and its held-out loss read.  The check: the two learners' GPUs are
disjoint, on paper and in ``nvidia-smi``.

On a host with one GPU two learners cannot have GPUs of their own: the check is then that
``diloco up --dry-run`` refuses them in one line.  ``--gpus 0,1`` lists the GPUs in the
region file instead of asking ``nvidia-smi`` (on a CPU machine: made-up ones, so that the
share-out and the learners' environment are checked; what the tests run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import benchmark_parser, wait_until_every_learner_trained, write_and_report
from diloco_cli.launch.devices import local_gpus

STEPS = {True: 30, False: 300}


def recipe(quick: bool) -> dict[str, Any]:
    return {
        "name": "gpu-learners",
        "model": {"factory": "diloco_cli.models.hf:causal_lm", "kwargs": {"config": "builtin:tiny-llama"}},
        "data": {"sequence_length": 64},
        "training": {
            "num_learners": 2,
            "batch_size": 8,
            "inner_steps": STEPS[quick],
            "warmup_steps": 5,
            "heartbeat_seconds": 0.5,
        },
        "sync": {"sync_interval": 10, "evaluate_every": 2, "evaluation_batches": 2},
    }


def regions(directory: Path, gpus: list[int] | None) -> dict[str, Any]:
    host: dict[str, Any] = {"name": "local", "learners": 2}
    if gpus is not None:
        host["gpus"] = gpus
    return {"regions": [{"name": "gpu", "bucket": f"file://{directory}/bucket", "hosts": [host]}]}


def diloco(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diloco_cli", *arguments], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def gpus_in_use() -> dict[int, int]:
    """Process id to the GPU index ``nvidia-smi`` shows it computing on (none without it)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", "--format=csv,noheader"]
    indices = dict(
        reversed(line.split(", "))
        for line in subprocess.run(
            [*query, "--query-gpu=index,uuid"], capture_output=True, text=True
        ).stdout.splitlines()
    )
    apps = subprocess.run([*query, "--query-compute-apps=pid,gpu_uuid"], capture_output=True, text=True).stdout
    return {int(pid): int(indices[uuid]) for pid, uuid in (line.split(", ") for line in apps.splitlines())}


def check(quick: bool, gpus: list[int] | None) -> dict[str, Any]:
    from diloco_cli.launch.runs import load_run
    from diloco_cli.views.run_state import collect_status

    directory = Path(tempfile.mkdtemp(prefix="diloco-gpu-learners-"))
    (directory / "recipe.json").write_text(json.dumps(recipe(quick)))
    (directory / "regions.json").write_text(json.dumps(regions(directory, gpus)))
    arguments = ["recipe.json", "--regions", "regions.json", "--runs-dir", "runs"]
    available = gpus if gpus is not None else list(local_gpus())
    if len(available) < 2:
        refused = diloco("up", *arguments, "--dry-run", cwd=directory)
        line = refused.stderr.strip()
        return {
            "gpus": available,
            "ran": False,
            "refused_in_one_line": refused.returncode == 2 and "\n" not in line and "GPUs" in line,
            "refusal": line,
        }
    started = time.perf_counter()
    up = diloco("up", *arguments, "--name", "two", cwd=directory)
    if up.returncode != 0:
        raise RuntimeError(f"diloco up failed: {up.stderr.strip()}")
    runs_dir = directory / "runs"
    wait_until_every_learner_trained(runs_dir, "two")
    record = load_run(runs_dir, "two")
    learners = {}
    on_gpu = gpus_in_use()
    for learner in record.spec.learners:
        pid = int(record.process_state(learner.id)["child_pid"])
        learners[learner.id] = {
            "given": list(learner.devices),
            "CUDA_VISIBLE_DEVICES": environment_of(pid).get("CUDA_VISIBLE_DEVICES"),
            "nvidia_smi_gpu": on_gpu.get(pid),
        }
    deadline = time.monotonic() + 900
    while (status := collect_status(record.spec, record.secret())).state != "finished":
        if time.monotonic() > deadline:
            raise RuntimeError(f"run two did not finish in 15 minutes (state {status.state})")
        time.sleep(1)
    seen = [entry["nvidia_smi_gpu"] for entry in learners.values()]
    given = [tuple(entry["given"]) for entry in learners.values()]
    result = {
        "gpus": available,
        "ran": True,
        "learners": learners,
        "disjoint_given": len(set(given)) == len(given) and all(given),
        "disjoint_in_nvidia_smi": None if None in seen else len(set(seen)) == len(seen),
        "heldout_loss": status.heldout_loss,
        "seconds": time.perf_counter() - started,
    }
    diloco("down", "two", "--runs-dir", "runs", cwd=directory)  # the reducer may still be on its last turn
    shutil.rmtree(directory, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = benchmark_parser(__doc__, f"{STEPS[True]} steps per learner (for the test suite)")
    parser.add_argument("--gpus", help="the GPUs to list in the region file, e.g. 0,1 (default: nvidia-smi's)")
    args = parser.parse_args(argv)
    gpus = [int(index) for index in args.gpus.split(",")] if args.gpus else None
    results = check(args.quick, gpus)
    print(json.dumps(results, indent=2))
    write_and_report("gpu-learners", args, {"gpus": args.gpus, "steps": STEPS[args.quick]}, results)
    return results


if __name__ == "__main__":
    main()
