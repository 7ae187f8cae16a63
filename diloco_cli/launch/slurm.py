"""Slurm: a run's processes on a cluster's compute nodes, as jobs submitted on its login node.

A host with a ``slurm`` section (:class:`~diloco_cli.config.regions.SlurmJobs`) is a
login node reached over SSH like any host: preflight, the install and the run's files go
there as they do everywhere (its ``venv`` and ``work_dir`` on a file system the compute
nodes share).  What differs is the start: each process placed on it is one ``sbatch``
job whose script runs the same supervisor an SSH host runs (:func:`job_script`), so
logs, process states and restarts after a crash are the same.  The scheduler adds what
an SSH host has not: a job is requeueable and is signalled ``signal_seconds`` before its
time limit; the script passes the signal to the supervisor, whose learner checkpoints
where it stands (issue: nothing trained twice), and requeues the job unless the run is
being stopped (:func:`stopping_marker`, written by ``diloco down``), so the job comes
back and resumes from that checkpoint.  It requeues only a job Slurm still runs: one
cancelled from outside (``scancel``) stays cancelled until ``diloco resume`` submits it
again, and one Slurm requeued or preempted comes back as Slurm has it.

The pure parts (the job script, reading ``squeue``) are apart from the calls over SSH
(submit, cancel, look)."""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import paramiko

from diloco_cli.config.regions import HostConfig, SlurmJobs
from diloco_cli.launch.ssh import SSHError, put_text, run

LIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SUSPENDED",
        "SIGNALING",
        "STAGE_OUT",
    }
)
"""Job states in which the job will still run (or runs): its process is not down."""


@dataclass(frozen=True)
class JobState:
    """One job as the scheduler shows it."""

    job: str
    state: str
    """``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``CANCELLED`` ... (Slurm's words)."""
    reason: str = ""
    """Why it is pending (``Resources``, ``Priority`` ...), or empty."""
    node: str = ""
    """The node it runs on, once it runs."""
    seen: float | None = None
    """When the scheduler last showed it so, for a state kept in the run's record
    (:func:`last_seen`); None for what it shows now."""
    accounting: bool = False
    """Told by ``sacct`` (the site's accounting, or its job completion log) after
    ``squeue`` and ``scontrol`` forgot the job: how it ended, though nobody looked then."""

    @property
    def live(self) -> bool:
        """Whether the job runs or will: a job gone from the scheduler's view never will."""
        return self.seen is None and self.state in LIVE_STATES

    def describe(self) -> str:
        """``running on node-3``, ``pending (Resources)``, ``failed``; for a job gone from
        the scheduler's view, its last state and when: ``completed, last seen 14:02:10``."""
        words = self.state.lower().replace("_", " ")
        if self.node and self.state == "RUNNING":
            words = f"{words} on {self.node}"
        elif self.reason and self.reason != "None":
            words = f"{words} ({self.reason})"
        if self.accounting:
            words = f"{words} (sacct)"
        if self.seen is not None:
            return f"{words}, last seen {time.strftime('%H:%M:%S', time.localtime(self.seen))}"
        return words


def last_seen(shown: Mapping[str, JobState], kept: Mapping[str, JobState], now: float) -> dict[str, JobState]:
    """What to keep of each job: what the scheduler ``shown`` now (seen ``now``), else
    what was ``kept`` of it before.  Without accounting storage a finished job leaves
    ``squeue`` and ``scontrol`` within minutes (``MinJobAge``); its last state is kept so
    that ``status`` can still say how it ended."""
    return {**kept, **{job: replace(state, seen=now) for job, state in shown.items()}}


def stopping_marker(run_dir: str, name: str) -> str:
    """A file whose presence tells a signalled job not to requeue itself (the run is stopped)."""
    return f"{run_dir}/processes/{name}.stopping"


def job_script(
    slurm: SlurmJobs,
    run: str,
    name: str,
    kind: str,
    run_dir: str,
    supervisor: Sequence[str],
    env: Mapping[str, str],
) -> str:
    """The ``sbatch`` script of process ``name``: the host's resources (a learner's GPUs,
    CPUs and memory; one CPU for the reducer and the syncer), requeueable, signalled before
    its time limit; it runs ``supervisor`` (the supervisor's command line) with ``env``,
    passes SIGTERM on, and after a signal requeues itself if Slurm still runs it (the
    time limit's signal) and the run is not stopping."""
    options = [f"--job-name=diloco-{run}-{name}", f"--partition={slurm.partition}"]
    options += [f"--account={slurm.account}"] if slurm.account else []
    options += [f"--qos={slurm.qos}"] if slurm.qos else []
    options += [f"--time={slurm.time_limit}"] if slurm.time_limit else []
    nodes = slurm.nodes_per_learner if kind == "learner" else 1
    if kind == "learner":
        options.append(f"--cpus-per-task={slurm.cpus_per_task}")
        options += [f"--mem={slurm.memory}"] if slurm.memory else []
        options += [f"--gres=gpu:{slurm.gpus_per_learner}"] if slurm.gpus_per_learner else []
    else:
        options.append("--cpus-per-task=1")
    options += [
        f"--nodes={nodes}",
        "--ntasks=1" if nodes == 1 else "--ntasks-per-node=1",
        "--requeue",
        f"--signal=B:TERM@{slurm.signal_seconds}",
        f"--output={run_dir}/logs/{name}.slurm.log",
        "--open-mode=append",
        *slurm.sbatch_options,
    ]
    variables = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    marker = shlex.quote(stopping_marker(run_dir, name))
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in options),
        f"# diloco: process {name} of run {run}",
        *slurm.setup,
        f"cd {shlex.quote(run_dir)} || exit 1",
        f"env {variables} {' '.join(shlex.quote(part) for part in supervisor)} &",
        "supervisor=$!",
        "on_signal() {",
        '  kill -TERM "$supervisor" 2>/dev/null',
        '  wait "$supervisor"',
        # requeue only a job the scheduler still runs (signalled before its time limit): one
        # it cancelled (scancel), requeued or preempted itself is left as the scheduler has it
        f"  if [ ! -e {marker} ] && scontrol -o show job \"$SLURM_JOB_ID\" | grep -q 'JobState=RUNNING'; then",
        '    echo "diloco: signalled before the time limit: requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  fi",
        "  exit 0",
        "}",
        "trap on_signal TERM",
        'wait "$supervisor"',
        "code=$?",
        'wait "$supervisor" 2>/dev/null',  # a signal ends the first wait early; the trap then exits
        "exit $code",
        "",
    ]
    return "\n".join(lines)


def submit(client: paramiko.SSHClient, host: HostConfig, run_dir: str, name: str, script: str) -> str:
    """Write the job's script in the run's folder on the login node and ``sbatch`` it;
    returns the job id.  An error says the host, the job and what sbatch said."""
    path = f"{run_dir}/processes/{name}.sbatch"
    put_text(client, script, path, mode=0o644)
    result = run(
        client,
        f"rm -f {shlex.quote(stopping_marker(run_dir, name))} && sbatch --parsable {shlex.quote(path)}",
        timeout=60,
    )
    job = result.stdout.strip().split(";")[0]
    if result.code != 0 or not job.isdigit():
        said = (result.stderr.strip() or result.stdout.strip())[-500:]
        raise SSHError(f"host {host.name}: sbatch refused {name}: {said}")
    return job


def parse_squeue(text: str) -> dict[str, JobState]:
    """``squeue -h -o '%i|%T|%r|%N'`` lines, by job id."""
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0]:
            states[parts[0]] = JobState(parts[0], parts[1], parts[2], parts[3])
    return states


def parse_scontrol(text: str) -> JobState | None:
    """One job from ``scontrol -o show job ID`` (it keeps a finished job a few minutes)."""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "JobId" not in fields:
        return None
    node = fields.get("NodeList", "")
    return JobState(
        fields["JobId"], fields.get("JobState", ""), fields.get("Reason", ""), "" if node == "(null)" else node
    )


def parse_sacct(text: str) -> dict[str, JobState]:
    """``sacct -n -P -o JobID,State,NodeList`` lines, by job id: a job requeued has a line
    per run, the last one says how it ended (``CANCELLED by 0`` is ``CANCELLED``)."""
    states = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0].isdigit() and parts[1]:
            node = "" if parts[2] in ("", "None assigned", "(null)") else parts[2]
            states[parts[0]] = JobState(parts[0], parts[1].split()[0], node=node, accounting=True)
    return states


SACCT_QUERIES = (
    "sacct -n -X -P -o JobID,State,NodeList -j {jobs}",
    "sacct -c -n -P -o jobid,state,nodelist -j {jobs}",
)
"""The site's accounting storage (``-X``: the job, not its steps), else its job completion
log (``JobCompType``, read with ``-c``); a site with neither answers no query."""


def job_states(client: paramiko.SSHClient, jobs: Sequence[str]) -> dict[str, JobState]:
    """What the scheduler says of ``jobs``: ``squeue`` for those it still queues or runs,
    ``scontrol show job`` for the rest (finished ones stay a few minutes), ``sacct`` for
    those both forgot where the site keeps accounting or a job completion log; a job known
    to none is absent from the answer."""
    if not jobs:
        return {}
    listed = run(client, f"squeue -h -o '%i|%T|%r|%N' -j {','.join(jobs)}", timeout=60)
    states = parse_squeue(listed.stdout) if listed.code == 0 else {}
    for job in [job for job in jobs if job not in states]:
        shown = run(client, f"scontrol -o show job {job}", timeout=60)
        state = parse_scontrol(shown.stdout) if shown.code == 0 else None
        if state is not None:
            states[job] = state
    forgotten = [job for job in jobs if job not in states]
    for query in SACCT_QUERIES if forgotten else ():
        accounted = run(client, query.format(jobs=",".join(forgotten)), timeout=60)
        if accounted.code == 0:
            states.update({job: state for job, state in parse_sacct(accounted.stdout).items() if job in forgotten})
            break
    return states


def cancel(client: paramiko.SSHClient, run_dir: str, jobs: Mapping[str, str], timeout: float) -> dict[str, str]:
    """Stop the jobs (process name -> job id) as ``down`` stops processes: mark each as
    stopping (so it does not requeue itself), SIGTERM its script (the supervisor passes it
    on, the learner checkpoints), wait up to ``timeout`` for the jobs to end, then
    ``scancel`` what is left.  Returns each name's outcome."""
    if not jobs:
        return {}
    markers = " ".join(shlex.quote(stopping_marker(run_dir, name)) for name in jobs)
    run(client, f"touch {markers}", timeout=60)
    states = job_states(client, list(jobs.values()))
    running = [job for job in jobs.values() if job in states and states[job].state == "RUNNING"]
    waiting = [job for job in jobs.values() if job in states and states[job].live and job not in running]
    if waiting:  # nothing of theirs runs yet: no checkpoint to write (a signal would hang on them)
        run(client, f"scancel {' '.join(waiting)}", timeout=60)
    if running:
        run(client, f"scancel --batch --signal=TERM {' '.join(running)}", timeout=60)
    ids = ",".join(jobs.values())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(state.live for state in job_states(client, list(jobs.values())).values()):
            return {name: "stopped" for name in jobs}
        time.sleep(1.0)
    run(client, f"scancel {ids.replace(',', ' ')}", timeout=60)
    return {name: "killed" for name in jobs}


SLURM_COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _gpus_per_node(gres: str) -> int:
    """The most GPUs one node of a partition has, from ``sinfo -o %G`` (``gpu:2``,
    ``gpu:a100:4(S:0-1)``, ``(null)``; several kinds comma-separated)."""
    most = 0
    for part in gres.split(","):
        fields = part.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            most = max(most, int(fields[-1]))
    return most


def check_cluster(client: paramiko.SSHClient, host: HostConfig, regions: Sequence[str]) -> tuple[str, str | None]:
    """What preflight checks on a login node before anything is submitted: Slurm's
    commands, the partition, the GPUs a learner asks for against the partition's nodes,
    then the whole request (account, QoS, time limit, options) with ``sbatch --test-only``.
    Returns the check's line and the first problem (None: fine), each naming the region,
    the host and the key to change."""
    slurm = host.slurm
    assert slurm is not None
    where = f"region {', '.join(regions)}, host {host.name}"
    found = run(client, "for c in " + " ".join(SLURM_COMMANDS) + '; do command -v "$c" >/dev/null || echo "$c"; done')
    if missing := found.stdout.split():
        return "FAIL", (
            f"{where}: {', '.join(missing)} not found on the login node's PATH; is it a Slurm login node? "
            "(add the line that makes them available, e.g. a module load, to the host's env or fix the address)"
        )
    listed = run(client, "sinfo -h -o '%P|%G'", timeout=60)
    partitions: dict[str, int] = {}
    for line in listed.stdout.splitlines():
        name, _, gres = line.partition("|")
        name = name.rstrip("*")
        partitions[name] = max(partitions.get(name, 0), _gpus_per_node(gres))
    if slurm.partition not in partitions:
        return "FAIL", (
            f"{where}: slurm.partition {slurm.partition!r} does not exist there "
            f"(its partitions: {', '.join(sorted(partitions)) or 'none'}); set slurm.partition to one of them"
        )
    if slurm.gpus_per_learner > partitions[slurm.partition]:
        return "FAIL", (
            f"{where}: slurm.gpus_per_learner is {slurm.gpus_per_learner}, and no node of partition "
            f"{slurm.partition} has more than {partitions[slurm.partition]} GPUs; ask for fewer, or choose a partition "
            "with larger nodes"
        )
    learner = job_script(slurm, "preflight", "preflight", "learner", "/tmp", ["true"], {})
    options = [line.removeprefix("#SBATCH ") for line in learner.splitlines() if line.startswith("#SBATCH ")]
    options = [o for o in options if not o.startswith(("--output=", "--open-mode=", "--signal="))]
    tested = run(client, f"sbatch --test-only {' '.join(shlex.quote(o) for o in options)} --wrap true", timeout=60)
    if tested.code != 0:
        said = (tested.stderr.strip() or tested.stdout.strip()).splitlines()[-1:] or ["?"]
        return "FAIL", (
            f"{where}: Slurm refuses a learner's job: {said[0].removeprefix('sbatch: error: ')}; "
            "check slurm.account, slurm.qos, slurm.time_limit, slurm.memory and slurm.sbatch_options"
        )
    gpus = f", {slurm.gpus_per_learner} GPU(s) a learner" if slurm.gpus_per_learner else ""
    return f"partition {slurm.partition}{gpus}", None


PROBE_WAIT_SECONDS = 300.0
"""How long preflight waits for its bucket probe job (queued, then run) on a cluster."""


def run_probe_job(
    client: paramiko.SSHClient, host: HostConfig, command: str, folder: str, timeout: float = PROBE_WAIT_SECONDS
) -> tuple[str, str | None]:
    """Run ``command`` (preflight's bucket probe) as a short job where the host's jobs run
    (its partition, account and QoS; one CPU, as a reducer's job; its ``setup`` lines
    first), with its output in ``folder``, and wait for it.  Returns where it ran
    (``compute node node-3, probe job 14``) and the problem (None: the command succeeded), which says
    the job's id; a job still queued after ``timeout`` is cancelled and said so."""
    slurm = host.slurm
    assert slurm is not None
    output = f"{folder}/bucket-probe-{host.name}.slurm.log"  # hosts may share the folder
    options = [f"--partition={slurm.partition}", "--job-name=diloco-bucket-probe", "--nodes=1", "--ntasks=1"]
    options += [f"--account={slurm.account}"] if slurm.account else []
    options += [f"--qos={slurm.qos}"] if slurm.qos else []
    options += ["--cpus-per-task=1", "--time=5", f"--output={output}", *slurm.sbatch_options]
    wrap = "\n".join([*slurm.setup, command])
    submitted = run(
        client,
        f"mkdir -p {shlex.quote(folder)} && rm -f {shlex.quote(output)} && "
        f"sbatch --parsable {' '.join(shlex.quote(o) for o in options)} --wrap {shlex.quote(wrap)}",
        timeout=60,
    )
    job = submitted.stdout.strip().split(";")[0]
    if submitted.code != 0 or not job.isdigit():
        said = (submitted.stderr.strip() or submitted.stdout.strip())[-300:]
        return "FAIL", f"sbatch refused the bucket probe job: {said}"
    deadline = time.monotonic() + timeout
    while (seen := job_states(client, [job]).get(job)) is not None and seen.live:
        if time.monotonic() > deadline:
            run(client, f"scancel {job}", timeout=60)
            return f"probe job {job}", (
                f"the bucket probe job {job} did not run within {timeout:.0f} s ({seen.describe()}); cancelled it. "
                "Is the partition full or the request too large? (squeue shows why a job waits)"
            )
        time.sleep(1.0)
    where = f"compute node {seen.node}, probe job {job}" if seen is not None and seen.node else f"probe job {job}"
    if seen is not None and seen.state == "COMPLETED":
        return where, None
    said = run(client, f"tail -n 5 {shlex.quote(output)}", timeout=60).stdout.strip().splitlines()[-1:] or ["?"]
    state = seen.describe() if seen is not None else "gone from the scheduler"
    return where, f"on a compute node (probe job {job}, {state}): {said[0]}"
