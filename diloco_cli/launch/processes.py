"""Detached, supervised processes on this machine: start them, see them, stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessRecord:
    """A supervised process of a run (the supervisor is its session and group leader)."""

    name: str
    kind: str
    pid: int
    """Its supervisor's pid (0 for a Slurm job: the supervisor runs on a compute node)."""
    host: str = "local"
    job: str | None = None
    """Its Slurm job id, where its host is a Slurm login node."""


def start_supervised(name: str, kind: str, command: list[str], run_dir: Path, env: dict[str, str]) -> ProcessRecord:
    """Start ``command`` under a supervisor in a session of its own (it outlives us)."""
    log_path = run_dir / "logs" / f"{name}.log"
    state_path = run_dir / "processes" / f"{name}.json"
    supervisor = [sys.executable, "-m", "diloco_cli.launch.supervisor", str(log_path), str(state_path), "--", *command]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            supervisor,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
            cwd=run_dir,
        )
    return ProcessRecord(name=name, kind=kind, pid=process.pid)


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def belongs_to(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` is still a supervisor of this run (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            arguments = cmdline.read().split(b"\0")
    except FileNotFoundError:
        return False
    return b"diloco_cli.launch.supervisor" in arguments and any(
        str(run_dir).encode() in argument for argument in arguments
    )


def group_members(pgid: int) -> list[int]:
    """Live processes in a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def stop_supervised(records: list[ProcessRecord], run_dir: Path, timeout: float = 30.0) -> dict[str, str]:
    """SIGTERM every supervisor (it stops its child), SIGKILL whatever is left after
    ``timeout``; returns how each process ended."""
    outcome: dict[str, str] = {}
    live = []
    for record in records:
        if is_running(record.pid) and belongs_to(record.pid, run_dir):
            os.kill(record.pid, signal.SIGTERM)
            live.append(record)
        else:
            outcome[record.name] = "not running"
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        live = [record for record in live if group_members(record.pid)]
        time.sleep(0.1)
    for record in records:
        if outcome.get(record.name) == "not running" and not group_members(record.pid):
            continue
        if record in live:
            outcome[record.name] = "killed after timeout"
        else:
            outcome.setdefault(record.name, "stopped")
        try:
            os.killpg(record.pid, signal.SIGKILL)  # stragglers of the group, if any
        except (ProcessLookupError, PermissionError):
            pass
    return outcome


def main(argv: list[str]) -> int:
    """``python -m diloco_cli.launch.processes stop RUN_DIR TIMEOUT NAME=PID...``: the same
    stop, run on an SSH host by ``diloco down``; prints the outcome as JSON."""
    import json

    if len(argv) < 3 or argv[0] != "stop":
        print("usage: python -m diloco_cli.launch.processes stop RUN_DIR TIMEOUT NAME=PID...", file=sys.stderr)
        return 2
    run_dir, timeout = Path(argv[1]), float(argv[2])
    records = [
        ProcessRecord(name=name, kind="", pid=int(pid)) for name, _, pid in (item.partition("=") for item in argv[3:])
    ]
    print(json.dumps(stop_supervised(records, run_dir, timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
