"""The logs of a run's processes, here or on SSH hosts, as text as it comes.

Each log is given whole (headed by its process when there are several); with ``follow``
what it gains is given too, until its process is done (its supervisor exited: finished,
stopped, or gave up) or the reader stops (Ctrl-C).  A log on an SSH host is followed by
``tail --pid`` of its supervisor there, so it ends the same way.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Iterator

from diloco_cli.config.errors import ConfigError
from diloco_cli.launch.processes import belongs_to, is_running
from diloco_cli.launch.runs import RunRecord

POLL_SECONDS = 0.2


def process_names(record: RunRecord, process: str | None) -> list[str]:
    """The processes whose logs are asked for (all when ``process`` is None)."""
    known = list(record.placement())
    if process is not None and process not in known:
        raise ConfigError(f"run {record.name} has no process {process!r} (processes: {', '.join(known)})")
    return [process] if process else known


def log_text(record: RunRecord, names: list[str], follow: bool) -> Iterator[str]:
    """Every asked-for log, one after another, then (following) what they gain."""
    hosts = record.placement()
    several = len(names) > 1
    local = [name for name in names if hosts[name] == "local"]
    for name in names:
        if hosts[name] != "local":
            if several:
                yield f"==> {name} on {hosts[name]} <==\n"
            yield from _remote_log(record, name, follow)
    if local:
        yield from _local_logs(record, local, follow, several)


def _local_logs(record: RunRecord, names: list[str], follow: bool, several: bool) -> Iterator[str]:
    handles = {}
    try:
        for name in names:
            if several:
                yield f"==> {name} <==\n"
            path = record.log_path(name)
            if not path.exists():
                yield "(no output yet)\n"
                continue
            handles[name] = open(path, "rb")
            yield handles[name].read().decode(errors="replace")
        while follow and any(_running(record, name) for name in names):
            for name in names:
                if name not in handles and record.log_path(name).exists():
                    handles[name] = open(record.log_path(name), "rb")
                for line in handles[name].readlines() if name in handles else []:
                    yield (f"{name}: " if several else "") + line.decode(errors="replace")
            time.sleep(POLL_SECONDS)
        for name, handle in handles.items():  # what came while its process ended
            for line in handle.readlines() if follow else []:
                yield (f"{name}: " if several else "") + line.decode(errors="replace")
    finally:
        for handle in handles.values():
            handle.close()


def _running(record: RunRecord, name: str) -> bool:
    """Whether the process's supervisor is still at work (it may still write)."""
    pid = next((p["pid"] for p in record.processes if p["name"] == name), None)
    return pid is not None and is_running(pid) and belongs_to(pid, record.directory)


def _remote_log(record: RunRecord, name: str, follow: bool) -> Iterator[str]:
    from diloco_cli.launch.remote import connect_recorded_host, remote_paths  # paramiko: only when asked

    client, host = connect_recorded_host(record.hosts, record.ssh, record.placement()[name])
    try:
        paths = remote_paths(client, host, record.name)
        pid = next((p["pid"] for p in record.processes if p["name"] == name), None)
        until = f"--pid={int(pid)} -F" if follow and pid else ""
        channel = client.get_transport().open_session()
        channel.exec_command(f"tail -n +1 {until} {shlex.quote(paths.log(name))}")
        try:
            while not (channel.exit_status_ready() and not channel.recv_ready()):
                if channel.recv_ready():
                    yield channel.recv(65536).decode(errors="replace")
                else:
                    time.sleep(0.1)
        finally:
            channel.close()
    finally:
        client.close()
