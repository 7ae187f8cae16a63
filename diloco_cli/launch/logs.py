"""The logs of a run's processes, here or on SSH hosts, as text as it comes.

Each log is given whole (headed by its process when there are several); with ``follow``
what it gains is given too, until its process is done (its supervisor exited: finished,
stopped, or gave up) or the reader stops (Ctrl-C).  A log on an SSH host is followed by
``tail --pid`` of its supervisor there, so it ends the same way.  A Slurm job's log (on
the file system its login node shares with the compute nodes) is followed until the
scheduler no longer runs or queues the job, and Slurm's own output of the job (its
``.slurm.log``: requeues, cancellations, srun's errors) comes after it.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Iterator

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
        process = next((p for p in record.processes if p["name"] == name), {})
        log = shlex.quote(paths.log(name))
        if job := process.get("job"):
            yield from _job_log(client, job, log, f"{paths.run_dir}/logs/{name}.slurm.log", follow)
            return
        until = f"--pid={int(process['pid'])} -F" if follow and process.get("pid") else ""
        yield from _command_output(client, f"tail -n +1 {until} {log}")
    finally:
        client.close()


JOB_LOOK_SECONDS = 2.0
"""How often a followed job's state is asked of the scheduler."""


def _job_log(client, job: str, log: str, slurm_log: str, follow: bool) -> Iterator[str]:
    """A Slurm job's log (followed while the scheduler runs or queues the job), then
    Slurm's own output of it, headed, where there is any."""
    from diloco_cli.launch.slurm import job_states

    if follow:
        looked = [time.monotonic()]

        def job_live() -> bool:
            if time.monotonic() - looked[0] < JOB_LOOK_SECONDS:
                return True
            looked[0] = time.monotonic()
            state = job_states(client, [job]).get(job)
            return state is not None and state.live

        yield from _command_output(client, f"tail -n +1 -F {log} 2>/dev/null", job_live)
    else:
        yield from _command_output(client, f"tail -n +1 {log}")
    heading, path = f"==> Slurm's output of job {job} ({slurm_log}) <==", shlex.quote(slurm_log)
    yield from _command_output(client, f"[ -s {path} ] && echo {shlex.quote(heading)} && cat {path}")


def _command_output(client, command: str, going_on: Callable[[], bool] = lambda: True) -> Iterator[str]:
    """What ``command`` prints over SSH as it comes, until it exits or ``going_on()`` says
    no more (then what it printed so far is given, and it is closed)."""
    channel = client.get_transport().open_session()
    channel.exec_command(command)
    try:
        while not (channel.exit_status_ready() and not channel.recv_ready()):
            if channel.recv_ready():
                yield channel.recv(65536).decode(errors="replace")
            elif not going_on():
                time.sleep(0.5)  # what the job wrote as it ended
                while channel.recv_ready():
                    yield channel.recv(65536).decode(errors="replace")
                return
            else:
                time.sleep(0.1)
    finally:
        channel.close()
