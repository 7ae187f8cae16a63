"""The local registry of runs: ``runs/<run>/`` directories made by ``diloco up``."""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_cli.codec import RunSecret
from diloco_cli.config.errors import ConfigError
from diloco_cli.launch.processes import belongs_to, is_running

if TYPE_CHECKING:
    from diloco_cli.launch.slurm import JobState
    from diloco_cli.store.run_spec import RunSpec

SYNCER_SILENT_SECONDS = 30.0
"""A syncer whose report is older than this is taken for down."""


@dataclass
class RunRecord:
    """A run started here: its record (``runs/<run>/run.json``) as written by ``up``.
    The resolved run (``spec``) is validated on first use: listing runs and reading
    their logs need only the record."""

    directory: Path
    document: dict[str, Any]

    @property
    def name(self) -> str:
        return self.document["spec"]["run"]

    @property
    def created(self) -> float:
        return float(self.document["spec"]["created"])

    @functools.cached_property
    def spec(self) -> RunSpec:
        from diloco_cli.store.run_spec import RunSpec

        return RunSpec.model_validate(self.document["spec"])

    @property
    def launcher(self) -> str:
        return self.document["launcher"]

    @property
    def processes(self) -> list[dict[str, Any]]:
        return self.document["processes"]

    @processes.setter
    def processes(self, processes: list[dict[str, Any]]) -> None:
        self.document["processes"] = processes

    @property
    def hosts(self) -> dict[str, dict[str, Any]]:
        """SSH hosts by name (their region-file entries), for down, logs and probes."""
        return self.document.get("hosts", {})

    @property
    def ssh(self) -> dict[str, Any]:
        return self.document.get("ssh", {})

    def placement(self) -> dict[str, str]:
        """Which host each process of the run runs on ("local" for this machine)."""
        spec = self.document["spec"]
        chaos = {"chaos": "local"} if spec.get("chaos") else {}  # the driver runs where `up` ran
        shards = spec["syncer"].get("shards") or [{"name": "syncer", "host": spec["syncer"]["host"]}]
        return {
            **{shard["name"]: shard["host"] for shard in shards},
            **chaos,
            **{f"reducer-{reducer['region']}": reducer["host"] for reducer in spec.get("reducers", ())},
            **{learner["id"]: learner["host"] for learner in spec["learners"]},
        }

    @property
    def secret_path(self) -> Path:
        return self.directory / "secret"

    def secret(self) -> RunSecret:
        return RunSecret.from_hex(self.secret_path.read_text())

    def log_path(self, process: str) -> Path:
        return self.directory / "logs" / f"{process}.log"

    def save(self) -> None:
        """Write the run record back (after processes were started again)."""
        write_run_record(self.directory, self.document)

    def jobs_seen(self) -> dict[str, JobState]:
        """The last state the scheduler showed of each Slurm job of the run, by job id
        (``jobs.json``, kept by ``status --probe``: finished jobs leave its view)."""
        from diloco_cli.launch.slurm import JobState

        try:
            document = json.loads((self.directory / "jobs.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return {job: JobState(**state) for job, state in document.items()}

    def keep_jobs_seen(self, states: dict[str, JobState]) -> None:
        """Write ``jobs.json`` (several ``status`` may run at once: each replaces it whole)."""
        temporary = self.directory / f"jobs.json.{os.getpid()}"
        temporary.write_text(json.dumps({job: asdict(state) for job, state in states.items()}, indent=2))
        os.replace(temporary, self.directory / "jobs.json")

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
        newest = newest_run(runs_dir)
        if newest is None:
            raise ConfigError(f"no runs in {runs_dir}; start one with `diloco up`")
        return newest
    directory = runs_dir / name
    try:
        document = json.loads((directory / "run.json").read_text())
    except FileNotFoundError:
        known = ", ".join(record.name for record in list_runs(runs_dir)[-5:]) or "none"
        raise ConfigError(f"no run {name!r} in {runs_dir} (recent runs: {known}); `diloco runs` lists them") from None
    if not isinstance(document, dict) or "spec" not in document or "processes" not in document:
        raise ConfigError(f"{directory / 'run.json'} is not a run record of diloco")
    return RunRecord(directory, document)


def newest_run(runs_dir: Path) -> RunRecord | None:
    """The run started last here, or None when none was."""
    records = list_runs(runs_dir.resolve())
    return records[-1] if records else None


def list_runs(runs_dir: Path) -> list[RunRecord]:
    """Every run in ``runs_dir``, oldest first."""
    records = []
    for path in sorted(runs_dir.glob("*/run.json")) if runs_dir.exists() else []:
        try:
            records.append(load_run(runs_dir, path.parent.name))
        except (ValueError, KeyError):  # a damaged record: not a run to list
            continue
    return sorted(records, key=lambda record: record.created)


@dataclass(frozen=True)
class RunSummary:
    """One line of ``diloco runs``."""

    name: str
    created: float
    learners: int
    """Active learners (M now: drained ones left out)."""
    regions: tuple[str, ...]
    hosts: tuple[str, ...]
    """Where its processes run ("local" for this machine)."""
    state: str
    """finished, running, stopped (by ``down``), failed (a supervisor gave up), down (its
    processes are gone without finishing), or the syncer's state when all run elsewhere."""


def summarize_run(record: RunRecord) -> RunSummary:
    """A run's state from its supervisors here and, for processes on SSH hosts, its
    syncer's report in a bucket (pids of other machines mean nothing here)."""
    states = []
    for process in record.processes:
        if process.get("host", "local") != "local":
            continue
        recorded = (record.process_state(process["name"]) or {}).get("state", "unknown")
        alive = is_running(process["pid"]) and belongs_to(process["pid"], record.directory)
        states.append(recorded if alive or recorded in ("finished", "stopped", "failed") else "down")
    if len(states) < len(record.processes):  # some run on hosts: ask the syncer's report
        states += _syncer_states(record.spec)
    for state in ("failed", "down", "running", "restarting", "starting", "stopped", "unknown"):
        if state in states:
            return _summary(record, "running" if state in ("restarting", "starting") else state)
    return _summary(record, "finished" if states else "unknown")


def _summary(record: RunRecord, state: str) -> RunSummary:
    hosts = tuple(dict.fromkeys(process.get("host", "local") for process in record.processes))
    spec = record.document["spec"]
    regions = tuple(region["name"] for region in spec["regions"])
    return RunSummary(
        record.name,
        record.created,
        sum(1 for learner in spec["learners"] if not learner.get("drain")),
        regions,
        hosts,
        state,
    )


def _syncer_states(spec: RunSpec) -> list[str]:
    """Each syncer shard's own report, read once without retries (``runs`` must answer fast)."""
    from diloco_cli.config.recipe import RetryPolicy
    from diloco_cli.store.region import RegionBucket

    region = spec.regions[0]
    bucket = RegionBucket(region.name, region.root, region.storage_options, None, RetryPolicy(attempts=1))
    states = []
    for shard in bucket.syncer_shards(len(spec.syncer_shards)):
        try:
            status = shard.read_syncer_status()
        except Exception:
            states.append("unknown")
            continue
        if status is None:
            states.append("starting")
        elif status.state.value == "running" and time.time() - status.time > SYNCER_SILENT_SECONDS:
            states.append("down")
        else:
            states.append(status.state.value)
    return states
