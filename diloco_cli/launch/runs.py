"""The local registry of runs: ``runs/<run>/`` directories made by ``diloco up``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_cli.codec import RunSecret
from diloco_cli.config.loading import ConfigError
from diloco_cli.runtime.run_spec import RunSpec


@dataclass
class RunRecord:
    directory: Path
    spec: RunSpec
    launcher: str
    processes: list[dict[str, Any]]
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """SSH hosts by name (their region-file entries), for down, logs and probes."""
    ssh: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.run

    @property
    def secret_path(self) -> Path:
        return self.directory / "secret"

    def secret(self) -> RunSecret:
        return RunSecret.from_hex(self.secret_path.read_text())

    def log_path(self, process: str) -> Path:
        return self.directory / "logs" / f"{process}.log"

    def save(self) -> None:
        """Write the run record back (after processes were started again)."""
        write_run_record(
            self.directory,
            {"spec": json.loads(self.spec.to_json()), "launcher": self.launcher, "processes": self.processes, "hosts": self.hosts, "ssh": self.ssh},
        )

    def process_state(self, process: str) -> dict[str, Any] | None:
        path = self.directory / "processes" / f"{process}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            return None


def write_run_record(run_dir: Path, record: dict) -> None:
    temporary = run_dir / "run.json.tmp"
    temporary.write_text(json.dumps(record, indent=2))
    os.replace(temporary, run_dir / "run.json")


def load_run(runs_dir: Path, name: str | None) -> RunRecord:
    """A run by name, or the newest run when ``name`` is None."""
    runs_dir = runs_dir.resolve()
    if name is None:
        records = list_runs(runs_dir)
        if not records:
            raise ConfigError(f"no runs in {runs_dir}; start one with `diloco up`")
        return records[-1]
    directory = runs_dir / name
    try:
        document = json.loads((directory / "run.json").read_text())
    except FileNotFoundError:
        known = ", ".join(record.name for record in list_runs(runs_dir)[-5:]) or "none"
        raise ConfigError(f"no run {name!r} in {runs_dir} (recent runs: {known}); `diloco runs` lists them") from None
    return RunRecord(
        directory,
        RunSpec.model_validate(document["spec"]),
        document["launcher"],
        document["processes"],
        document.get("hosts", {}),
        document.get("ssh", {}),
    )


def list_runs(runs_dir: Path) -> list[RunRecord]:
    """Every run in ``runs_dir``, oldest first."""
    records = []
    for path in sorted(runs_dir.glob("*/run.json")) if runs_dir.exists() else []:
        try:
            records.append(load_run(runs_dir, path.parent.name))
        except (ValueError, KeyError):
            continue
    return sorted(records, key=lambda record: record.spec.created)
