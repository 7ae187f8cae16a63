"""Operations on a started run wherever its processes are, here or on SSH hosts: stop
them, read their logs, probe their supervisors."""

from __future__ import annotations

import sys
from collections import defaultdict

from diloco_cli.launch.local import stop_local
from diloco_cli.launch.processes import ProcessRecord, is_running
from diloco_cli.launch.remote import connect_recorded_host, remote_paths, stop_remote, stream_remote_log, supervisor_states
from diloco_cli.launch.ssh import SSHError
from diloco_cli.launch.runs import RunRecord


def stop_run(record: RunRecord, timeout: float = 30.0) -> dict[str, tuple[str, str]]:
    """Stop every process of the run on every host; returns process -> (host, outcome)."""
    by_host: dict[str, list[ProcessRecord]] = defaultdict(list)
    for process in record.processes:
        by_host[process.get("host", "local")].append(ProcessRecord(**process))
    outcome: dict[str, tuple[str, str]] = {}
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


def stream_host_logs(record: RunRecord, names: list[str], follow: bool) -> None:
    """Print (and follow) the logs of processes that run on SSH hosts."""
    placement = {"syncer": record.spec.syncer.host, **{learner.id: learner.host for learner in record.spec.learners}}
    for name in names:
        client, host = connect_recorded_host(record.hosts, record.ssh, placement[name])
        try:
            if len(names) > 1:
                sys.stdout.write(f"==> {name} on {host.name} <==\n")
            stream_remote_log(client, remote_paths(client, host, record.name), name, follow, sys.stdout.write)
            sys.stdout.flush()
        finally:
            client.close()


def probe_run(record: RunRecord) -> list[dict]:
    """Per process: its host, whether the host answers over SSH, and its supervisor's
    recorded state (running, restarting, finished, stopped, failed) and liveness."""
    rows = []
    by_host: dict[str, list[dict]] = defaultdict(list)
    for process in record.processes:
        by_host[process.get("host", "local")].append(process)
    for host_name, processes in by_host.items():
        if host_name == "local":
            for process in processes:
                state = record.process_state(process["name"]) or {}
                rows.append(_probe_row(process, "local", "-", state, is_running(process["pid"])))
            continue
        try:
            client, host = connect_recorded_host(record.hosts, record.ssh, host_name)
        except SSHError as error:
            rows += [_probe_row(process, host_name, f"unreachable: {error}", {}, False) for process in processes]
            continue
        try:
            states = supervisor_states(client, remote_paths(client, host, record.name))
        finally:
            client.close()
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
    }
