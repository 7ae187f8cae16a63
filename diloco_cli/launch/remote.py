"""The SSH launcher: a run's processes on remote hosts, detached and supervised there.

Each host gets the run's files in ``<work_dir>/<run>/`` over SFTP (the manifest, and the
secret readable by its owner only), then one supervisor per learner started with
``setsid`` so it outlives the SSH session.  Stopping, logs and probes go over SSH too and
reuse the same supervisor and process code as the local launcher.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import paramiko

from diloco_cli.codec import RunSecret
from diloco_cli.config.regions import HostConfig
from diloco_cli.launch.local import learner_threads
from diloco_cli.launch.processes import ProcessRecord
from diloco_cli.launch.services import services
from diloco_cli.launch.ssh import SSHError, expand_home, put_text, run
from diloco_cli.store.run_spec import RunSpec


@dataclass(frozen=True)
class RemotePaths:
    """Where a run lives on one host."""

    venv: str
    run_dir: str

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python"

    def log(self, name: str) -> str:
        return f"{self.run_dir}/logs/{name}.log"

    def state(self, name: str) -> str:
        return f"{self.run_dir}/processes/{name}.json"


def remote_paths(client: paramiko.SSHClient, host: HostConfig, run: str) -> RemotePaths:
    return RemotePaths(venv=expand_home(client, host.venv), run_dir=f"{expand_home(client, host.work_dir)}/{run}")


def install_run_files(client: paramiko.SSHClient, paths: RemotePaths, spec: RunSpec, secret: RunSecret) -> None:
    """The manifest and the secret (mode 0600, over SSH only) on the host."""
    run(client, f"mkdir -p {shlex.quote(paths.run_dir)}/logs {shlex.quote(paths.run_dir)}/processes")
    put_text(client, json.dumps({"spec": json.loads(spec.to_json())}), f"{paths.run_dir}/run.json", mode=0o644)
    put_text(client, secret.to_hex(), f"{paths.run_dir}/secret", mode=0o600)


def start_services(
    client: paramiko.SSHClient, host: HostConfig, paths: RemotePaths, spec: RunSpec, names: Collection[str], cores: int
) -> list[ProcessRecord]:
    """Start these processes of the run on ``host`` (:mod:`~diloco_cli.launch.services`):
    its learners share its ``cores``; the syncer and reducers take one thread each."""
    threads = learner_threads(spec, host.name, cores) if host.slurm is None else host.slurm.cpus_per_task
    records = []
    for service in services(spec, names):
        nodes = host.slurm.nodes_per_learner if host.slurm is not None and service.kind == "learner" else 1
        command = service.command(paths.python, f"{paths.run_dir}/run.json", f"{paths.run_dir}/secret", nodes)
        env = {"OMP_NUM_THREADS": "1" if service.single_threaded else str(threads), **dict(service.environment)}
        if host.slurm is not None:
            records.append(submit_job(client, host, paths, spec.run, service.name, service.kind, command, env))
        else:
            records.append(start_remote_process(client, host, paths, service.name, service.kind, command, env))
    return records


def _supervisor(paths: RemotePaths, name: str, command: list[str]) -> list[str]:
    """The supervisor's command line for process ``name`` (its log and state in the run's folder)."""
    return [paths.python, "-m", "diloco_cli.launch.supervisor", paths.log(name), paths.state(name), "--", *command]


def submit_job(
    client: paramiko.SSHClient,
    host: HostConfig,
    paths: RemotePaths,
    run_name: str,
    name: str,
    kind: str,
    command: list[str],
    env: dict[str, str],
) -> ProcessRecord:
    """Submit one supervised process as a Slurm job on the login node ``host``."""
    from diloco_cli.launch.slurm import job_script, submit

    assert host.slurm is not None
    script = job_script(
        host.slurm,
        run_name,
        name,
        kind,
        paths.run_dir,
        _supervisor(paths, name, command),
        {**env, **host.env, "PYTHONUNBUFFERED": "1"},
    )
    run(client, f"rm -f {shlex.quote(paths.state(name))}")
    job = submit(client, host, paths.run_dir, name, script)
    return ProcessRecord(name=name, kind=kind, pid=0, host=host.name, job=job)


def start_remote_process(
    client: paramiko.SSHClient,
    host: HostConfig,
    paths: RemotePaths,
    name: str,
    kind: str,
    command: list[str],
    env: dict[str, str],
) -> ProcessRecord:
    """Start one supervised process detached from the SSH session; returns its supervisor."""
    variables = " ".join(
        f"{key}={shlex.quote(value)}" for key, value in {**env, **host.env, "PYTHONUNBUFFERED": "1"}.items()
    )
    supervisor = _supervisor(paths, name, command)
    # Only the supervisor goes to the background (in a subshell with every stream
    # redirected), so the SSH command returns at once and the session can end.
    script = (
        f"cd {shlex.quote(paths.run_dir)} && rm -f {shlex.quote(paths.state(name))} && "
        f"(env {variables} setsid nohup {' '.join(shlex.quote(part) for part in supervisor)} "
        f">> {shlex.quote(paths.log(name))} 2>&1 < /dev/null &)"
    )
    result = run(client, script, timeout=60)
    if result.code != 0:
        raise SSHError(f"host {host.name}: could not start {name}: {result.stderr.strip()[-500:]}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the supervisor records its own pid once it runs
        state = run(client, f"cat {shlex.quote(paths.state(name))} 2>/dev/null").stdout
        if state.strip():
            return ProcessRecord(name=name, kind=kind, pid=int(json.loads(state)["supervisor_pid"]), host=host.name)
        time.sleep(0.2)
    log = run(client, f"tail -n 20 {shlex.quote(paths.log(name))}").stdout
    raise SSHError(f"host {host.name}: {name} did not start within 30 s; its log ends:\n{log}")


def stop_remote(
    client: paramiko.SSHClient, paths: RemotePaths, records: list[ProcessRecord], timeout: float
) -> dict[str, str]:
    """SIGTERM, then SIGKILL after ``timeout``, on the host (the local launcher's code);
    Slurm jobs through the scheduler (:func:`diloco_cli.launch.slurm.cancel`)."""
    jobs = {r.name: r.job for r in records if r.job is not None}
    if jobs:
        from diloco_cli.launch.slurm import cancel

        return cancel(client, paths.run_dir, jobs, timeout)
    pids = " ".join(f"{shlex.quote(r.name)}={r.pid}" for r in records)
    result = run(
        client,
        f"{shlex.quote(paths.python)} -m diloco_cli.launch.processes stop "
        f"{shlex.quote(paths.run_dir)} {timeout} {pids}",
        timeout=timeout + 60,
    )
    if result.code != 0:
        raise SSHError(f"stopping processes failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def supervisor_states(
    client: paramiko.SSHClient, paths: RemotePaths, jobs: dict[str, str] | None = None, kept: Mapping | None = None
) -> dict[str, dict]:
    """Each supervised process's recorded state on the host; for processes that are
    Slurm jobs (``jobs``: name -> job id) whether the job still runs or waits to, with
    the scheduler's word for it (``job``: its id, ``job_state``: running on node-3,
    pending (Resources) ...; ``job_shown``: the :class:`~diloco_cli.launch.slurm.JobState`
    the scheduler showed, None when it no longer knows the job and its state ``kept``
    from earlier, by job id, is shown instead)."""
    if jobs:
        return _job_states(client, paths, jobs, kept or {})
    script = (
        f"for f in {shlex.quote(paths.run_dir)}/processes/*.json; do "
        '[ -f "$f" ] && printf \'%s\\t\' "$(basename "$f" .json)" && cat "$f" && echo; done'
    )
    states = {}
    for line in run(client, script).stdout.splitlines():
        name, _, document = line.partition("\t")
        try:
            states[name] = json.loads(document)
        except ValueError:
            continue
    alive = run(
        client,
        " ; ".join(
            f"kill -0 {int(s['supervisor_pid'])} 2>/dev/null && echo {shlex.quote(n)}" for n, s in states.items()
        )
        or "true",
    ).stdout.split()
    for name, state in states.items():
        state["supervisor_alive"] = name in alive
    return states


def connect_recorded_host(record_hosts: dict, ssh_settings: dict, name: str) -> tuple[paramiko.SSHClient, HostConfig]:
    """Reconnect to a host of a started run (its key must be the one accepted at ``up``)."""
    from diloco_cli.config.regions import SSHSettings
    from diloco_cli.launch.ssh import SSHTarget, connect

    host = HostConfig.model_validate(record_hosts[name])
    settings = SSHSettings.model_validate(ssh_settings or {})
    target = SSHTarget(
        host.name,
        host.address or host.name,
        host.port,
        host.user,
        host.key_file,
        settings.known_hosts,
        settings.connect_timeout,
    )
    return connect(target), host


def _job_states(client: paramiko.SSHClient, paths: RemotePaths, jobs: dict[str, str], kept: Mapping) -> dict[str, dict]:
    from diloco_cli.launch.slurm import LIVE_STATES, job_states

    recorded = supervisor_states(client, paths)
    scheduled = job_states(client, list(jobs.values()))
    states = {}
    for name, job in jobs.items():
        state = dict(recorded.get(name, {}))
        seen = scheduled.get(job, kept.get(job))
        state["job"], state["job_shown"] = job, scheduled.get(job)
        state["job_state"] = seen.describe() if seen is not None else "gone from the scheduler"
        state["supervisor_alive"] = seen is not None and seen.live
        if seen is None or state.get("state") == "finished" or seen.state == "COMPLETED":
            pass  # the supervisor's word (a job completes after its supervisor finished or was stopped)
        elif seen.live and seen.state == "PENDING":
            state["state"] = "pending"  # queued (again: requeued, held), not the supervisor that ran before
        elif not seen.live:  # cancelled (from outside too), failed, timed out, or gone while it ran or waited
            state["state"] = "gone" if seen.state in LIVE_STATES else seen.state.lower()
        states[name] = state
    return states
