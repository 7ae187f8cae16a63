"""Regions on a Slurm cluster: a real slurmctld, slurmd and munged on this machine (two
partitions as two regions), its login node a real sshd in front of it, learners and
reducers as jobs submitted with sbatch over SSH."""

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


def test_learners_and_reducers_run_as_slurm_jobs_requeued_and_stopped(tmp_path, host_venv, login_node):
    """up submits one job per learner and reducer (GPUs asked of the scheduler), status
    shows each job and where it runs, a learner requeued by the scheduler comes back
    from its checkpoint, the run finishes with a clean ledger, and down cancels what is
    left of another run without requeueing it."""
    cluster, server = login_node
    runs_dir = tmp_path / "runs"
    regions = regions_yaml(tmp_path, server, host_venv, east={"partition": "east", "gpus_per_learner": 1})
    recipe = write_yaml(
        tmp_path / "tiny.yaml",
        deep_update(SSH_RECIPE, {"training": {"inner_steps": 4000, "checkpoint_every_steps": 1000}}),
    )
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
    record = load_run(runs_dir, "jobs")
    jobs = {p["name"]: p["job"] for p in record.processes if p.get("job")}
    assert set(jobs) == {"east-0", "west-0", "reducer-east", "reducer-west"}, record.processes
    script = (tmp_path / "shared-home" / "jobs" / "processes" / "east-0.sbatch").read_text()
    assert "#SBATCH --partition=east" in script and "#SBATCH --gres=gpu:1" in script and "--requeue" in script
    queued = cluster.run("squeue", "-h", "-o", "%i %P %j").stdout
    assert re.search(rf"{jobs['west-0']}\s+west\s+diloco-jobs-west-0", queued), queued

    wait_for(runs_dir, "jobs", lambda s: s.learners[0].step >= 20, 300, "east-0 training")
    shown = diloco("status", "jobs", "--probe", "--runs-dir", str(runs_dir)).stdout
    assert "slurm job" in shown and re.search(rf"{jobs['east-0']} running on {cluster.node}", shown), shown

    # the scheduler requeues east-0 (as a preemption would): SIGTERM, it checkpoints where
    # it stands, the job waits out Slurm's requeue delay (here cut short) and comes back
    cluster.run("scontrol", "requeue", jobs["east-0"])
    time.sleep(3)
    cluster.run("scontrol", "update", f"JobId={jobs['east-0']}", "StartTime=now", check=False)
    status = wait_finished(runs_dir, "jobs", timeout=600)
    assert all(row.state == "finished" for row in status.learners), status.learners
    restarts = cluster.run("scontrol", "-o", "show", "job", jobs["east-0"]).stdout
    assert "Restarts=1" in restarts or "Restarts=2" in restarts, restarts
    log = (tmp_path / "shared-home" / "jobs" / "logs" / "east-0.log").read_text()
    assert "checkpointing where it stands, then stopping" in log, log[-3000:]
    resumed = re.search(r"resumed from checkpoint at step (\d+)", log)
    assert resumed and 0 < int(resumed[1]) < 4000 and int(resumed[1]) % 1000, log[
        -3000:
    ]  # where it stood, not a periodic one
    audit_ledger(runs_dir / "jobs", load_run(runs_dir, "jobs").secret())
    assert_every_token_accounted(runs_dir, "jobs", heartbeats(runs_dir, "jobs"))
    assert_bases_are_the_syncers(runs_dir, "jobs")

    # down: every job of a second run ends, none is requeued
    diloco("up", str(recipe), "--regions", str(regions), "--name", "stopped", "--runs-dir", str(runs_dir),
           "--set", "training.inner_steps=100000", timeout=900)  # fmt: skip
    wait_for(runs_dir, "stopped", lambda s: s.learners[0].step >= 5, 300, "training")
    second = {p["name"]: p["job"] for p in load_run(runs_dir, "stopped").processes if p.get("job")}
    diloco("down", "stopped", "--runs-dir", str(runs_dir), timeout=300)
    time.sleep(2)
    left = cluster.run("squeue", "-h", "-o", "%i", "-j", ",".join(second.values()), check=False).stdout.split()
    assert left == [], left
    states = [cluster.run("scontrol", "-o", "show", "job", job).stdout for job in second.values()]
    assert all("Restarts=0" in state for state in states), states


def test_preflight_refuses_what_the_cluster_cannot_run_by_region_and_key(tmp_path, host_venv, login_node):
    """An unknown partition, more GPUs than a node has, more memory than a node has: one
    line each naming the region, the host and the key, before anything is
    submitted."""
    cluster, server = login_node
    before = cluster.jobs()
    cases = [
        ({"partition": "gpux"}, r"region east, host login-east: slurm.partition 'gpux' does not exist there "
                                r"\(its partitions: east, west\)"),
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
    assert cluster.jobs() == before  # nothing was submitted
