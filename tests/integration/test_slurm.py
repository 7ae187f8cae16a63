"""Regions on a Slurm cluster: a real slurmctld, slurmd and munged on this machine (two
partitions as two regions), its login node a real sshd in front of it, learners and
reducers as jobs submitted with sbatch over SSH."""

import json
import re
import time

import pytest

from diloco_cli.launch.runs import load_run
from tests.integration.test_ssh import SSH_RECIPE, host_entry, known_hosts_of
from tests.support.runs import (
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    audit_ledger,
    deep_update,
    diloco,
    heartbeats,
    wait_finished,
    wait_for,
    write_yaml,
)
from tests.support.slurm import slurm_cluster
from tests.support.sshd import sshd_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def login_node(tmp_path_factory):
    """A Slurm cluster and the sshd of its login node (its sessions see the cluster)."""
    root = tmp_path_factory.mktemp("cluster")
    with slurm_cluster(root) as cluster, sshd_server(root, extra_config=cluster.sshd_config) as server:
        yield cluster, server


def login_host(server, name, venv, tmp_path, learners=1, **slurm):
    """A test SSH host (tests/integration/test_ssh.py's) that is the cluster's login node."""
    shared = str(tmp_path / "shared-home")  # the file system the compute nodes share
    return host_entry(server, name, venv, tmp_path, learners, work_dir=shared, slurm=slurm)


def regions_yaml(tmp_path, server, venv, east=None, west=None):
    return write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [login_host(server, "login-east", venv, tmp_path, **(east or {"partition": "east"}))],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [login_host(server, "login-west", venv, tmp_path, **(west or {"partition": "west"}))],
                },
            ],
            "syncer": {"host": "local"},
            "ssh": {"known_hosts": str(known_hosts_of(tmp_path, server))},
        },
    )


def probed(runs_dir, run):
    """``status RUN --probe -o json``: the run's status with its processes' rows by name."""
    document = json.loads(diloco("status", run, "--probe", "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    return document, {row["process"]: row for row in document["probe"]}


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.5)
    return found


def test_learners_and_reducers_run_as_slurm_jobs_requeued_and_stopped(tmp_path, host_venv, login_node):
    """up submits one job per learner and reducer (GPUs asked of the scheduler), status
    shows each job and where it runs; east-0 requeued and held by the scheduler shows as
    pending with Slurm's reason, comes back from its checkpoint once released, and once
    cancelled from outside is submitted again by resume and goes on from its checkpoint;
    west's jobs have a one-minute time limit: signalled before it, they checkpoint,
    requeue themselves and go on; the run finishes with a clean ledger, status reads how
    a job ended from sacct after the scheduler forgot it; in another run scale adds a
    learner's job and drains it again (the job completes), and down cancels what is left
    without requeueing it."""
    cluster, server = login_node
    runs_dir = tmp_path / "runs"
    # signalled 30 s into each minute: on an idle machine the tiny model trains its 3000
    # steps in about 40 s, so a later signal could come after it had finished
    west = {"partition": "west", "time_limit": "1", "signal_seconds": 30}
    regions = regions_yaml(tmp_path, server, host_venv, east={"partition": "east", "gpus_per_learner": 1}, west=west)
    # the tiny model publishes several versions a second: east-0, held or cancelled for
    # ~20 s, would come back more than the default W=32 versions behind and be told to
    # resync; a window of 1000 keeps these pauses within it (its work is merged, not
    # overwritten), as a pause of minutes is within it at the version rate of a real model
    # (a resync once reinstalled the version a learner had just sent from, and a send
    # from it then superseded that one: tests/unit/test_learner_polls.py)
    changes = {"training": {"inner_steps": 3000, "checkpoint_every_steps": 1000}, "sync": {"window_versions": 1000}}
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(SSH_RECIPE, changes))
    started = diloco(
        "up",
        str(recipe),
        "--regions",
        str(regions),
        "--name",
        "jobs",
        "--runs-dir",
        str(runs_dir),
        "--chaos",
        "keep-payloads",
        timeout=900,
    )  # fmt: skip (payloads kept for the audit)
    assert "from Slurm" in started.stdout and "started reducer-east, east-0" in started.stdout, started.stdout
    # each region's bucket was probed from a compute node, in a job named by its id
    for host in ("login-east", "login-west"):
        probe = rf"{host}: bucket ok from compute node {cluster.node}, probe job (\d+)"
        assert re.search(probe, started.stdout), started.stdout
    record = load_run(runs_dir, "jobs")
    jobs = {p["name"]: p["job"] for p in record.processes if p.get("job")}
    assert set(jobs) == {"east-0", "west-0", "reducer-east", "reducer-west"}, record.processes
    home = tmp_path / "shared-home" / "jobs"
    script = (home / "processes" / "east-0.sbatch").read_text()
    assert "#SBATCH --partition=east" in script and "#SBATCH --gres=gpu:1" in script and "--requeue" in script
    assert "#SBATCH --time=1" in (home / "processes" / "west-0.sbatch").read_text()
    queued = cluster.run("squeue", "-h", "-o", "%i %P %j").stdout
    assert re.search(rf"{jobs['west-0']}\s+west\s+diloco-jobs-west-0", queued), queued

    east_step = lambda s: next(row.step for row in s.learners if row.learner == "east-0")  # noqa: E731
    wait_for(runs_dir, "jobs", lambda s: east_step(s) >= 20, 300, "east-0 training")
    shown = diloco("status", "jobs", "--probe", "--runs-dir", str(runs_dir)).stdout
    assert "slurm job" in shown and re.search(rf"{jobs['east-0']} running on {cluster.node}", shown), shown

    # the scheduler requeues east-0 and holds it (as an admin or a preemption would):
    # SIGTERM, it checkpoints where it stands, and it waits in the queue with a reason
    east = jobs["east-0"]
    cluster.run("scontrol", "requeuehold", east)
    pending = lambda: "PENDING" in cluster.run("squeue", "-h", "-o", "%T", "-j", east).stdout  # noqa: E731
    wait_until(pending, 60, "east-0 pending")
    document, rows = probed(runs_dir, "jobs")
    learner = next(row for row in document["learners"] if row["learner"] == "east-0")
    assert learner["state"] == "pending (job requeued in held state)", learner
    assert rows["east-0"]["supervisor"] == "pending" and rows["east-0"]["supervisor_alive"], rows["east-0"]
    assert f"east-0 waits in Slurm's queue: job {east} pending (job requeued in held state)" in document["problems"]
    assert not any("east-0 is down" in problem for problem in document["problems"]), document["problems"]
    cluster.run("scontrol", "release", east)  # it runs again after Slurm's requeue delay
    log = home / "logs" / "east-0.log"
    resumed_at = lambda: [int(step) for step in re.findall(r"resumed from checkpoint at step (\d+)", log.read_text())]  # noqa: E731
    first = wait_until(resumed_at, 120, "east-0 back from its checkpoint")[0]
    assert 0 < first < 3000 and first % 1000, log.read_text()[-3000:]  # where it stood, not a periodic one
    assert "Restarts=1" in cluster.run("scontrol", "-o", "show", "job", east).stdout

    # cancelled from outside: the job does not requeue itself, status says it is down,
    # and resume submits it again; it goes on from the checkpoint it wrote on the signal
    wait_for(runs_dir, "jobs", lambda s: east_step(s) >= first + 50, 300, "east-0 training again")
    cluster.run("scancel", east)
    wait_until(lambda: not cluster.run("squeue", "-h", "-j", east, check=False).stdout.strip(), 90, "east-0 gone")
    assert "JobState=CANCELLED" in cluster.run("scontrol", "-o", "show", "job", east).stdout
    document, rows = probed(runs_dir, "jobs")
    assert rows["east-0"]["supervisor"] == "cancelled" and not rows["east-0"]["supervisor_alive"], rows["east-0"]
    assert any(f"east-0 is down (Slurm job {east}: cancelled)" in p for p in document["problems"]), document
    resumed = diloco("resume", "jobs", "--runs-dir", str(runs_dir), timeout=300).stdout
    assert re.search(r"east-0\s+login-east\s+started again", resumed) and "west-0" not in resumed, resumed
    jobs["east-0"] = next(p["job"] for p in load_run(runs_dir, "jobs").processes if p["name"] == "east-0")
    assert jobs["east-0"] != east

    # east-0's job completes: status --probe keeps its state in the run's record while
    # Slurm still shows it (it forgets a finished job within about a minute here)
    east_state = lambda s: next(row.state for row in s.learners if row.learner == "east-0")  # noqa: E731
    wait_for(runs_dir, "jobs", lambda s: east_state(s) == "finished", 600, "east-0 finishing")
    completed = lambda: probed(runs_dir, "jobs")[1]["east-0"]["job_state"] == "completed"  # noqa: E731
    wait_until(completed, 60, "east-0's job completed")
    status = wait_finished(runs_dir, "jobs", timeout=600)
    assert all(row.state == "finished" for row in status.learners), status.learners
    steps = resumed_at()
    assert len(steps) == 2 and first < steps[1] < 3000, log.read_text()[-3000:]
    # west-0 was signalled before its time limit, checkpointed and requeued itself
    west_log = (home / "logs" / "west-0.log").read_text()
    assert "checkpointing where it stands" in west_log and "resumed from checkpoint at step" in west_log, west_log
    assert "signalled before the time limit: requeueing job" in (home / "logs" / "west-0.slurm.log").read_text()
    shown = diloco("logs", "jobs", "west-0", "--runs-dir", str(runs_dir)).stdout
    assert "resumed from checkpoint at step" in shown and f"==> Slurm's output of job {jobs['west-0']}" in shown
    assert "signalled before the time limit: requeueing job" in shown.split("==> Slurm's output")[1], shown
    audit_ledger(runs_dir / "jobs", load_run(runs_dir, "jobs").secret())
    assert_every_token_accounted(runs_dir, "jobs", heartbeats(runs_dir, "jobs"))
    assert_bases_are_the_syncers(runs_dir, "jobs")

    # scale and down: a second run (no time limit) gets one more learner's job, drains it
    # again; down ends every job, none is requeued
    regions = regions_yaml(tmp_path, server, host_venv)
    diloco("up", str(recipe), "--regions", str(regions), "--name", "stopped", "--runs-dir", str(runs_dir),
           "--set", "training.inner_steps=100000", timeout=900)  # fmt: skip
    wait_for(runs_dir, "stopped", lambda s: s.learners[0].step >= 5, 300, "training")
    # scale: a learner added to a Slurm region is one more job there, and it trains
    scaled = diloco("scale", "stopped", "--region", "west", "--learners", "+1", "--runs-dir", str(runs_dir)).stdout
    assert re.search(r"west-1\s+login-west\s+added", scaled), scaled
    second = {p["name"]: p["job"] for p in load_run(runs_dir, "stopped").processes if p.get("job")}
    assert (
        "west-1" in second
        and f"{second['west-1']} west diloco-stopped-west-1" in cluster.run("squeue", "-h", "-o", "%i %P %j").stdout
    )
    west_1 = lambda s: next(row.step for row in s.learners if row.learner == "west-1")  # noqa: E731
    wait_for(runs_dir, "stopped", lambda s: west_1(s) >= 5, 300, "west-1 training")
    # scale -1 drains west-1: it sends what it trained and stops, and its job completes
    # without requeueing itself
    drained = diloco("scale", "stopped", "--region", "west", "--learners", "-1", "--runs-dir", str(runs_dir)).stdout
    assert re.search(r"west-1\s+login-west\s+draining", drained), drained
    west_1_job = lambda: cluster.run("squeue", "-h", "-j", second["west-1"], check=False).stdout.strip()  # noqa: E731
    wait_until(lambda: not west_1_job(), 180, "west-1's job ending after its drain")
    ended = cluster.run("scontrol", "-o", "show", "job", second["west-1"]).stdout
    assert "JobState=COMPLETED" in ended and "Restarts=0" in ended, ended
    second.pop("west-1")
    diloco("down", "stopped", "--runs-dir", str(runs_dir), timeout=300)
    time.sleep(2)
    left = cluster.run("squeue", "-h", "-o", "%i", "-j", ",".join(second.values()), check=False).stdout.split()
    assert left == [], left
    states = [cluster.run("scontrol", "-o", "show", "job", job).stdout for job in second.values()]
    assert all("Restarts=0" in state for state in states), states

    # squeue and scontrol forget a finished job (MinJobAge): status asks sacct (here the
    # job completion log) how it ended, and keeps that in the run's record
    gone = lambda: cluster.run("scontrol", "show", "job", jobs["east-0"], check=False).returncode != 0  # noqa: E731
    wait_until(gone, 180, "Slurm forgetting east-0's job")
    _, rows = probed(runs_dir, "jobs")
    assert rows["east-0"]["job_state"] == "completed (sacct)", rows["east-0"]
    kept = json.loads((runs_dir / "jobs" / "jobs.json").read_text())[jobs["east-0"]]
    assert kept["state"] == "COMPLETED" and kept["accounting"], kept
    assert rows["east-0"]["supervisor"] == "finished", rows["east-0"]


def test_preflight_refuses_what_the_cluster_cannot_run_by_region_and_key(tmp_path, host_venv, login_node):
    """An unknown partition, more GPUs than a node has, more memory than a node has: one
    line each naming the region, the host and the key, before anything is
    submitted; and a bucket a compute node cannot use, by the probe job's id."""
    cluster, server = login_node
    before = cluster.jobs()
    cases = [
        ({"partition": "gpux"}, r"region east, host login-east: slurm.partition 'gpux' does not exist there "
                                r"\(its partitions: east, pair, west\)"),
        ({"partition": "east", "gpus_per_learner": 3}, r"region east, host login-east: slurm.gpus_per_learner is 3, "
                                                       r"and no node of partition east has more than 2 GPUs"),
        ({"partition": "east", "memory": "999G"}, r"region east, host login-east: Slurm refuses a learner's job: "
                                                  r".*Requested node configuration is not available; check slurm"),
    ]  # fmt: skip
    for east, expected in cases:
        regions = regions_yaml(tmp_path, server, host_venv, east=east)
        refused = diloco(
            "up", "--regions", str(regions), "--set", "training.num_learners=2", "--dry-run",
            "--runs-dir", str(tmp_path / "runs"), check=False,
        )  # fmt: skip
        assert refused.returncode != 0, refused.stdout
        assert re.search(expected, refused.stdout + refused.stderr), refused.stdout + refused.stderr
        assert "Traceback" not in refused.stderr
    assert set(cluster.jobs()) <= set(before)  # nothing was submitted (earlier jobs may have left the queue)
    # a bucket the compute nodes cannot use (here: the jobs' setup fails) is refused by
    # the probe job, named by its id, before any learner's job is submitted
    east = {"partition": "east", "setup": ["echo 'no route to the bucket from here'", "exit 3"]}
    regions = regions_yaml(tmp_path, server, host_venv, east=east)
    refused = diloco("up", "--regions", str(regions), "--set", "training.num_learners=2", "--name", "probed",
                     "--runs-dir", str(tmp_path / "runs"), check=False, timeout=600)  # fmt: skip
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "nothing was started" in said, said
    expected = r"host login-east, region east: on a compute node \(probe job \d+, failed[^:]*\): no route to the bucket"
    assert re.search(expected, said), said
    assert set(cluster.jobs()) <= set(before) and "Traceback" not in refused.stderr
    # a login host whose sessions do not find Slurm's commands (no module loaded)
    with sshd_server(tmp_path, extra_config=["SetEnv PATH=/nowhere"]) as bare:
        regions = regions_yaml(tmp_path, bare, host_venv)
        refused = diloco(
            "up", "--regions", str(regions), "--set", "training.num_learners=2", "--dry-run",
            "--runs-dir", str(tmp_path / "runs"), check=False,
        )  # fmt: skip
    said = refused.stdout + refused.stderr
    missing = "sbatch, squeue, scontrol, scancel, sinfo not found on the login node's PATH; is it a Slurm login node?"
    assert refused.returncode != 0 and f"region east, host login-east: {missing}" in said, said


def test_a_learner_spanning_two_nodes_trains_as_one_torchrun_group(tmp_path, host_venv, login_node):
    """slurm.nodes_per_learner 2: east-0's one job holds both nodes of partition pair (and
    every GPU of them), srun starts a torchrun on each, and the learner trains as one group
    of two processes (rank 0 on the first node talks to storage).  A learner added with
    scale waits in the queue for lack of GPUs: status shows it pending with Slurm's reason
    (Resources), and the run ends without waiting for it (never started), every token
    accounted for and the bases bit-equal to the syncer's; once the GPUs are free its job
    starts, and its learner sees the run over, trains nothing and leaves (logs --follow
    follows it until the job ends); rm cleans the run's folder on the cluster."""
    cluster, server = login_node
    runs_dir = tmp_path / "runs"
    east = host_entry(server, "login-east", host_venv, tmp_path, 1, work_dir=str(tmp_path / "shared-home"))
    east |= {"processes_per_learner": 1, "slurm": {"partition": "pair", "nodes_per_learner": 2, "gpus_per_learner": 2}}
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {"name": "east", "bucket": f"file://{tmp_path}/buckets/east", "hosts": [east]},
                {"name": "west", "bucket": f"file://{tmp_path}/buckets/west", "hosts": [{"name": "local"}]},
            ],
            "syncer": {"host": "local"},
            "ssh": {"known_hosts": str(known_hosts_of(tmp_path, server))},
        },
    )
    # 1500 steps: east-0 still trains (about 25 s on an idle machine) when east-1 is shown waiting
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(SSH_RECIPE, {"training": {"inner_steps": 1500}}))
    diloco("up", str(recipe), "--regions", str(regions), "--name", "pair", "--runs-dir", str(runs_dir), timeout=900)
    job = next(p["job"] for p in load_run(runs_dir, "pair").processes if p["name"] == "east-0")
    script = (tmp_path / "shared-home" / "pair" / "processes" / "east-0.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script, script

    def nodes_of_the_job():
        listed = cluster.run("squeue", "-h", "-o", "%T %N", "-j", job, check=False).stdout.split()
        if len(listed) != 2 or listed[0] != "RUNNING":
            return None
        return cluster.run("scontrol", "show", "hostnames", listed[1]).stdout.split()

    assert wait_until(nodes_of_the_job, 300, "east-0's job running") == list(cluster.nodes)
    # one more learner's job: east-0 holds every GPU of the partition, so it waits
    scaled = diloco("scale", "pair", "--region", "east", "--learners", "+1", "--runs-dir", str(runs_dir)).stdout
    assert re.search(r"east-1\s+login-east\s+added", scaled), scaled
    added = next(p["job"] for p in load_run(runs_dir, "pair").processes if p["name"] == "east-1")
    waiting = f"east-1 waits in Slurm's queue: job {added} pending (Resources)"
    wait_until(lambda: waiting in probed(runs_dir, "pair")[0]["problems"], 120, "east-1 shown pending (Resources)")
    # held, so that it stays queued once east-0's job frees the GPUs (on an idle machine the
    # tiny run ends within the liveness timeout, and east-1 would start before its end)
    cluster.run("scontrol", "hold", added)
    status = wait_finished(runs_dir, "pair", timeout=600)
    shown = diloco("status", "pair", "--runs-dir", str(runs_dir)).stdout
    assert re.search(r"the run went on without east-1: it never started \(\d+ s since the run began\)", shown), shown
    assert {row.learner: row.state for row in status.learners}["east-0"] == "finished"
    # east-1's job released: its learner sees the run over, trains nothing and leaves;
    # logs --follow follows its job's log over SSH until the scheduler is done with it
    cluster.run("scontrol", "release", added)
    late = diloco("logs", "pair", "east-1", "--follow", "--runs-dir", str(runs_dir), timeout=300).stdout
    assert "the run ended before this learner started" in late and "finished at step 0" in late, late
    assert not cluster.run("squeue", "-h", "-j", added, check=False).stdout.strip()
    beats = heartbeats(runs_dir, "pair")
    assert beats["east-0"].processes == 2 and beats["west-0"].processes == 1, beats
    assert beats["east-1"].state.value == "finished" and beats["east-1"].tokens == 0, beats["east-1"]
    log = (tmp_path / "shared-home" / "pair" / "logs" / "east-0.log").read_text()
    assert "srun --nodes=2" in log and "diloco_cli.launch.slurm_node" in log and "finished at step 1500" in log, log
    trained = {learner: beat for learner, beat in beats.items() if learner != "east-1"}
    assert_every_token_accounted(runs_dir, "pair", trained)
    assert_bases_are_the_syncers(runs_dir, "pair", learners=trained)
    # rm cleans what the jobs left on the cluster's shared file system
    diloco("rm", "pair", "--runs-dir", str(runs_dir), timeout=300)
    assert not (tmp_path / "shared-home" / "pair").exists() and not (runs_dir / "pair").exists()
