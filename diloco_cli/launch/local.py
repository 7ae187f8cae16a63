"""The local launcher: every learner and the syncer as supervised processes here."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

from diloco_cli.launch.processes import ProcessRecord, start_supervised, stop_supervised
from diloco_cli.launch.runs import RunRecord
from diloco_cli.store.run_spec import LearnerSpec, RunSpec

CHAOS_PROCESS = "chaos"


def learner_command(learner: LearnerSpec, manifest: Path, secret_path: Path) -> list[str]:
    arguments = [
        "-m",
        "diloco_cli",
        "_learner",
        "--manifest",
        str(manifest),
        "--learner",
        learner.id,
        "--secret-file",
        str(secret_path),
    ]
    if learner.processes > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={learner.processes}",
            *arguments,
        ]
    return [sys.executable, *arguments]


def syncer_command(manifest: Path, secret_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "diloco_cli",
        "_syncer",
        "--manifest",
        str(manifest),
        "--secret-file",
        str(secret_path),
    ]


def start_chaos_driver(run_dir: Path) -> ProcessRecord:
    """The run's chaos driver (its kills and pauses), supervised here like the others."""
    command = [sys.executable, "-m", "diloco_cli", "_chaos", "--run", run_dir.name, "--runs-dir", str(run_dir.parent)]
    return start_supervised(CHAOS_PROCESS, "chaos", command, run_dir, {"PYTHONUNBUFFERED": "1"})


def learner_threads(spec: RunSpec, host: str, cores: int) -> int:
    """CPU threads for each process of a learner on ``host`` (``local``: this machine),
    which has ``cores`` cores: the recipe's ``training.threads_per_learner``, else the
    cores shared out among every learner process the run places there (``resume`` starts
    only some, ``diloco sample`` none, and they get the same share)."""
    processes = sum(learner.processes for learner in spec.active_learners if learner.host == host) or 1
    return spec.recipe.training.threads_per_learner or max(1, cores // processes)


def start_local(spec: RunSpec, run_dir: Path, learners: list[LearnerSpec], with_syncer: bool) -> list[ProcessRecord]:
    """Start the syncer (if asked) and these learners, each with its share of this
    machine's CPU threads (:func:`learner_threads`)."""
    manifest, secret_path = run_dir / "run.json", run_dir / "secret"
    threads = learner_threads(spec, "local", os.cpu_count() or 1)
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    records = []
    if with_syncer:
        records.append(
            start_supervised(
                "syncer", "syncer", syncer_command(manifest, secret_path), run_dir, {**env, "OMP_NUM_THREADS": "1"}
            )
        )
    for learner in learners:
        records.append(
            start_supervised(learner.id, "learner", learner_command(learner, manifest, secret_path), run_dir, env)
        )
    return records


def stop_local(record: RunRecord, timeout: float = 30.0) -> dict[str, str]:
    processes = [ProcessRecord(**process) for process in record.processes if process.get("host", "local") == "local"]
    return stop_supervised(processes, record.directory, timeout)


def process_records_json(records: list[ProcessRecord]) -> list[dict]:
    return [asdict(record) for record in records]
