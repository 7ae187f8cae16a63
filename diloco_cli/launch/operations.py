"""Operations on a started run wherever its processes are, here or on SSH hosts: stop
them, probe their supervisors, restart what is down (their logs: launch/logs.py)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict

from diloco_cli.launch.local import CHAOS_PROCESS, start_chaos_driver, start_local, stop_local
from diloco_cli.launch.processes import ProcessRecord, belongs_to, is_running
from diloco_cli.launch.runs import RunRecord

# launch.remote and launch.ssh (paramiko, ~100 ms to import) are imported where a run has
# SSH hosts: status of a local run must not pay for them.


def stop_run(record: RunRecord, timeout: float = 30.0) -> dict[str, tuple[str, str]]:
    """Stop every process of the run on every host; returns process -> (host, outcome)."""
    by_host: dict[str, list[ProcessRecord]] = defaultdict(list)
    for process in record.processes:
        by_host[process.get("host", "local")].append(ProcessRecord(**process))
    outcome: dict[str, tuple[str, str]] = {}
    from diloco_cli.launch.remote import connect_recorded_host, remote_paths, stop_remote

    if "local" in by_host:
        outcome.update({name: ("local", how) for name, how in stop_local(record, timeout).items()})
    for host_name, processes in by_host.items():
        if host_name == "local":
            continue
        client, host = connect_recorded_host(record.hosts, record.ssh, host_name)
        try:
            results = stop_remote(client, remote_paths(client, host, record.name), processes, timeout)
        finally:
            client.close()
        outcome.update({name: (host_name, how) for name, how in results.items()})
    return outcome


def probe_run(record: RunRecord, remote: bool = True) -> list[dict]:
    """Per process: its host, whether the host answers over SSH, and its supervisor's
    recorded state (running, restarting, finished, stopped, failed) and liveness.
    Processes on this machine are always looked at; SSH hosts only with ``remote``."""
    rows = []
    by_host: dict[str, list[dict]] = defaultdict(list)
    for process in record.processes:
        by_host[process.get("host", "local")].append(process)
    for host_name, processes in by_host.items():
        if host_name == "local":
            for process in processes:
                state = record.process_state(process["name"]) or {}
                alive = is_running(process["pid"]) and belongs_to(process["pid"], record.directory)
                rows.append(_probe_row(process, "local", "-", state, alive))
            continue
        if not remote:
            continue
        from diloco_cli.launch.remote import connect_recorded_host, remote_paths, supervisor_states
        from diloco_cli.launch.ssh import SSHError

        try:
            client, host = connect_recorded_host(record.hosts, record.ssh, host_name)
        except SSHError as error:
            rows += [_probe_row(process, host_name, f"unreachable: {error}", {}, False) for process in processes]
            continue
        try:
            jobs = {process["name"]: process["job"] for process in processes if process.get("job")}
            kept = record.jobs_seen() if jobs else {}
            states = supervisor_states(client, remote_paths(client, host, record.name), jobs, kept)
        finally:
            client.close()
        if jobs:  # finished jobs leave the scheduler's view within minutes: keep what it showed
            from diloco_cli.launch.slurm import last_seen

            shown = {state["job"]: state["job_shown"] for state in states.values() if state.get("job_shown")}
            record.keep_jobs_seen(last_seen(shown, kept, time.time()))
        for process in processes:
            state = states.get(process["name"], {})
            rows.append(_probe_row(process, host_name, "ok", state, bool(state.get("supervisor_alive"))))
    return rows


def _probe_row(process: dict, host: str, ssh: str, state: dict, alive: bool) -> dict:
    return {
        "process": process["name"],
        "host": host,
        "ssh": ssh,
        "supervisor": state.get("state", "unknown") if alive or state else "gone",
        "supervisor_alive": alive,
        "restarts": state.get("restarts", 0),
        "crashes": state.get("crashes", 0),
        "last_error": state.get("last_error"),
        "job": state.get("job"),
        "job_state": state.get("job_state"),
    }


HEADS_REOPEN_SECONDS = 120.0
"""How long ``resume`` waits for restarted syncer shards to republish their heads before
it starts the learners anyway (a shard imports torch and restores its state first)."""


def resume_run(record: RunRecord, emit=lambda line: None, reopen_seconds: float = HEADS_REOPEN_SECONDS) -> list[str]:
    """Start again every process of the run that is down (its supervisor gone, or given
    up), here and on SSH hosts, from the run's durable state; the syncer (every shard) and
    the reducers too when a learner comes back after they finished, and those first: a
    learner that read the heads of the run's first end would take the run as over and
    leave.  A coordinator still finishing that first end is waited for, then started
    again with the others.  Returns the names started."""
    rows = {row["process"]: row for row in probe_run(record)}
    down = [name for name, row in rows.items() if not row["supervisor_alive"] and row["supervisor"] != "finished"]
    coordinators = [*(shard.name for shard in record.spec.syncer_shards), *(r.name for r in record.spec.reducers)]
    if not any(name not in (*coordinators, CHAOS_PROCESS) for name in down):
        return start_processes(record, down, "started again", emit)
    # learners come back after the syncer and reducers finished: they must merge what they send
    finishing = [name for name in coordinators if rows.get(name, {}).get("supervisor_alive")]
    if finishing and _some_head_finished(record):
        emit(f"  waiting for {', '.join(finishing)} to finish the run's first end; they start again then")
        rows = _wait_until_down(record, finishing, reopen_seconds)
        if still := [name for name in finishing if rows.get(name, {}).get("supervisor_alive")]:
            emit(f"  {', '.join(still)} still running after {reopen_seconds:.0f} s: resume again once it finished")
    down += [name for name in coordinators if name not in down and not rows.get(name, {}).get("supervisor_alive")]
    first = [name for name in down if name in coordinators]
    started = start_processes(record, first, "started again", emit)
    if first:
        emit("  waiting for the syncer to say in every region that the run goes on; the learners start then")
        if not wait_for_open_heads(record, reopen_seconds):
            emit(
                f"  the syncer has not republished its head in every region within {reopen_seconds:.0f} s: a learner "
                f"that reads the old one leaves; if `diloco status {record.name}` shows one down, resume again"
            )
    learners = [name for name in down if name not in first]
    return sorted(started + start_processes(record, learners, "started again", emit))


def _wait_until_down(record: RunRecord, names: list[str], timeout: float, poll_seconds: float = 0.5) -> dict:
    """Probe the run until none of ``names`` has a live supervisor or ``timeout`` passes;
    returns the last probe's rows by process."""
    deadline = time.monotonic() + timeout
    while True:
        rows = {row["process"]: row for row in probe_run(record)}
        if not any(rows.get(name, {}).get("supervisor_alive") for name in names) or time.monotonic() >= deadline:
            return rows
        time.sleep(poll_seconds)


def _heads(record: RunRecord) -> list | None:
    """The head of every syncer shard in every region (None where one is missing), or None
    when a region cannot be read now."""
    from diloco_cli.codec import PayloadError
    from diloco_cli.store.filesystem import StorageError

    spec, secret = record.spec, record.secret()
    views = [view for bucket in spec.buckets(secret) for view in bucket.syncer_shards(len(spec.syncer_shards))]
    try:
        return [view.read_head() for view in views]
    except (StorageError, PayloadError):
        return None


def _some_head_finished(record: RunRecord) -> bool:
    return any(head is not None and head.finished for head in _heads(record) or [])


def wait_for_open_heads(record: RunRecord, timeout: float, poll_seconds: float = 0.5) -> bool:
    """Wait until every region holds an unfinished head of every syncer shard (or none),
    as a restarted shard republishes it at its start; False when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        heads = _heads(record)  # a region not read now is read again until the deadline
        if heads is not None and all(head is None or not head.finished for head in heads):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_seconds)


def start_processes(record: RunRecord, names: list[str], how: str, emit=lambda line: None) -> list[str]:
    """Start these processes of the run (learners, the syncer, the chaos driver) where
    the run places them, here or on SSH hosts, and record them; returns their names."""
    if not names:
        return []
    spec = record.spec
    placement = record.placement()
    started: list[ProcessRecord] = []
    local = [name for name in names if placement[name] == "local"]
    if local:
        started += start_local(spec, record.directory, local)
        if CHAOS_PROCESS in local:
            started.append(start_chaos_driver(record.directory))
    for host_name in sorted({placement[name] for name in names} - {"local"}):
        from diloco_cli.launch.remote import connect_recorded_host, remote_paths, start_services
        from diloco_cli.launch.ssh import run as run_over_ssh

        client, host = connect_recorded_host(record.hosts, record.ssh, host_name)
        try:
            cores = int(run_over_ssh(client, "nproc").stdout.strip() or "1")
            on_host = [name for name in names if placement[name] == host_name]
            started += start_services(client, host, remote_paths(client, host, spec.run), spec, on_host, cores)
        finally:
            client.close()
    for process in started:
        emit(f"  {process.name:<16} {process.host:<12} {how}")
    replaced = {process.name for process in started}
    record.processes = [p for p in record.processes if p["name"] not in replaced] + [asdict(p) for p in started]
    record.save()
    return sorted(replaced)
