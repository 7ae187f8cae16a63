"""The local launcher: the run's processes (learners, reducers, the syncer) supervised here."""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

from diloco_cli.launch.processes import ProcessRecord, start_supervised, stop_supervised
from diloco_cli.launch.runs import RunRecord
from diloco_cli.store.run_spec import RunSpec

CHAOS_PROCESS = "chaos"


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


def start_local(spec: RunSpec, run_dir: Path, names: Collection[str]) -> list[ProcessRecord]:
    """Start these processes of the run here (:mod:`~diloco_cli.launch.services`): each
    learner with its share of this machine's CPU threads (:func:`learner_threads`), the
    syncer and reducers with one thread each."""
    from diloco_cli.launch.services import services  # their devices and regions: `status` need not load them

    manifest, secret_path = str(run_dir / "run.json"), str(run_dir / "secret")
    threads = learner_threads(spec, "local", os.cpu_count() or 1)
    records = []
    for service in services(spec, names):
        env = {
            "OMP_NUM_THREADS": "1" if service.single_threaded else str(threads),
            "PYTHONUNBUFFERED": "1",
            **dict(service.environment),
        }
        command = service.command(sys.executable, manifest, secret_path)
        records.append(start_supervised(service.name, service.kind, command, run_dir, env))
    return records


def stop_local(record: RunRecord, timeout: float = 30.0) -> dict[str, str]:
    processes = [ProcessRecord(**process) for process in record.processes if process.get("host", "local") == "local"]
    return stop_supervised(processes, record.directory, timeout)


def process_records_json(records: list[ProcessRecord]) -> list[dict]:
    return [asdict(record) for record in records]
