"""Slurm regions without a cluster: the region file's slurm section, the job script, and
reading what squeue and scontrol say (tests/integration/test_slurm.py runs a real one)."""

import re
import time
from pathlib import Path

import pytest

from diloco_cli.config.errors import ConfigError
from diloco_cli.config.files import load_regions
from diloco_cli.config.regions import SlurmJobs
from diloco_cli.launch.slurm import (
    JobState,
    _gpus_per_node,
    job_script,
    last_seen,
    parse_sacct,
    parse_scontrol,
    parse_squeue,
    stopping_marker,
)
from tests.support.runs import write_yaml


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [
        ({"partition": "a b"}, "partition"),
        ({"partition": "gpu", "time_limit": "two hours"}, "time_limit"),
        ({"partition": "gpu", "memory": "lots"}, "memory"),
        ({"partition": "gpu", "sbatch_options": ["constraint=a100"]}, "not options: give each as one '--name=value'"),
        ({"partition": "gpu", "setup": ["module load cuda\nrm -rf /"]}, "one shell line each"),
        ({}, "partition"),
    ],
)
def test_a_bad_slurm_section_is_refused_naming_its_key(tmp_path, slurm, expected):
    host = {"name": "login", "address": "login.cluster", "slurm": slurm}
    path = write_yaml(tmp_path / "regions.yaml", {"regions": [{"name": "c", "bucket": "file:///b", "hosts": [host]}]})
    with pytest.raises(ConfigError, match=expected):
        load_regions(path)


def test_a_login_node_is_reached_over_ssh_and_gives_no_gpu_list(tmp_path):
    for host, expected in (
        ({"name": "local", "slurm": {"partition": "gpu"}}, "reached over SSH"),
        ({"name": "login", "address": "x", "gpus": [0], "slurm": {"partition": "gpu"}}, "gpus_per_learner"),
    ):
        path = write_yaml(tmp_path / "r.yaml", {"regions": [{"name": "c", "bucket": "file:///b", "hosts": [host]}]})
        with pytest.raises(ConfigError, match=expected):
            load_regions(path)


def test_a_learners_job_asks_for_its_resources_is_requeueable_and_requeues_itself_unless_stopping():
    slurm = SlurmJobs(
        partition="gpu",
        account="proj-7",
        qos="high",
        time_limit="04:00:00",
        signal_seconds=300,
        gpus_per_learner=4,
        cpus_per_task=16,
        memory="128G",
        sbatch_options=("--constraint=a100",),
        setup=("module load cuda/12.4",),
    )
    supervisor = ["/venv/bin/python", "-m", "diloco_cli.launch.supervisor", "log", "state", "--", "python", "-m", "x"]
    script = job_script(slurm, "run-1", "east-0", "learner", "/home/u/runs/run-1", supervisor, {"A": "b c"})
    options = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert options == [
        "--job-name=diloco-run-1-east-0",
        "--partition=gpu",
        "--account=proj-7",
        "--qos=high",
        "--time=04:00:00",
        "--cpus-per-task=16",
        "--mem=128G",
        "--gres=gpu:4",
        "--nodes=1",
        "--ntasks=1",
        "--requeue",
        "--signal=B:TERM@300",
        "--output=/home/u/runs/run-1/logs/east-0.slurm.log",
        "--open-mode=append",
        "--constraint=a100",
    ]
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    # the setup line before diloco starts, the supervisor in the background with its environment
    assert lines.index("module load cuda/12.4") < next(i for i, line in enumerate(lines) if "supervisor" in line)
    assert "env A='b c' /venv/bin/python -m diloco_cli.launch.supervisor log state -- python -m x &" in lines
    assert "trap on_signal TERM" in lines and '    scontrol requeue "$SLURM_JOB_ID"' in lines
    # it requeues itself only while the scheduler still runs it (a time limit's signal),
    # never once it is stopping, or cancelled, requeued or preempted by the scheduler
    marker = stopping_marker("/home/u/runs/run-1", "east-0")
    assert (
        f"  if [ ! -e {marker} ] && scontrol -o show job \"$SLURM_JOB_ID\" | grep -q 'JobState=RUNNING'; then" in lines
    )
    # a reducer's or the syncer's job: one CPU, no GPU, no memory of a learner's
    reducer = job_script(slurm, "run-1", "reducer-east", "reducer", "/r", ["p"], {})
    assert "#SBATCH --cpus-per-task=1" in reducer and "--gres" not in reducer and "--mem" not in reducer


def test_a_learner_spanning_nodes_is_one_torchrun_group_started_by_srun_on_each():
    """nodes_per_learner 2: the job asks for 2 nodes (one task each, GPUs per node), the
    supervisor runs srun, whose task on each node becomes that node's torchrun, ranked by
    the node's place in the job and meeting at the first node on a port of the job's."""
    from diloco_cli.launch.services import Service
    from diloco_cli.launch.slurm_node import PORTS, torchrun_command

    slurm = SlurmJobs(partition="gpu", gpus_per_learner=8, nodes_per_learner=2)
    options = job_script(slurm, "r", "east-0", "learner", "/runs/r", ["p"], {}).splitlines()
    assert "#SBATCH --nodes=2" in options and "#SBATCH --ntasks-per-node=1" in options
    assert "#SBATCH --gres=gpu:8" in options and "#SBATCH --ntasks=1" not in options
    assert "#SBATCH --nodes=1" in job_script(slurm, "r", "reducer-east", "reducer", "/r", ["p"], {}).splitlines()
    learner = Service("east-0", "learner", "login", ("_learner", "--learner", "east-0"), processes=8)
    command = learner.command("/venv/bin/python", "/runs/r/run.json", "/runs/r/secret", nodes=2)
    learner_arguments = ["-m", "diloco_cli", "_learner", "--learner", "east-0"]
    learner_arguments += ["--manifest", "/runs/r/run.json", "--secret-file", "/runs/r/secret"]
    assert command == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "/venv/bin/python", "-m", "diloco_cli.launch.slurm_node", "8", "--", *learner_arguments,
    ]  # fmt: skip
    environ = {
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "20017",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5",
    }
    second = torchrun_command("/venv/bin/python", 8, learner_arguments, environ)
    assert second == [
        "/venv/bin/python", "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.5", "--master-port", str(PORTS[0] + 17), "--nproc-per-node=8", *learner_arguments,
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="runs under srun in a Slurm job .*SLURM_NNODES"):
        torchrun_command("python", 8, learner_arguments, {})


def test_what_squeue_and_scontrol_say_is_read_per_job():
    listed = parse_squeue("12|RUNNING|None|node-3\n13|PENDING|Resources|\n\n")
    assert listed["12"].describe() == "running on node-3" and listed["12"].live
    assert listed["13"].describe() == "pending (Resources)" and listed["13"].live
    shown = parse_scontrol("JobId=14 JobName=x JobState=COMPLETED Reason=None NodeList=node-1 Restarts=1")
    assert shown is not None and shown.state == "COMPLETED" and not shown.live and shown.describe() == "completed"
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified") is None


def test_what_sacct_says_of_a_job_the_scheduler_forgot_is_its_last_run():
    """Accounting (or the job completion log) lists a requeued job once per run: the
    last line says how it ended; ``CANCELLED by 0`` is cancelled; a step's line is not a job."""
    lines = ["21|COMPLETED|node-1", "22|PREEMPTED|node-2", "22|CANCELLED by 0|node-2", "22.batch|CANCELLED|node-2"]
    accounted = parse_sacct("\n".join([*lines, "23|PENDING|None assigned", ""]))
    assert accounted["21"].describe() == "completed (sacct)" and not accounted["21"].live
    assert accounted["22"].state == "CANCELLED" and accounted["22"].node == "node-2"
    assert accounted["23"].node == "" and accounted["23"].live  # what accounting says still waits, waits
    assert set(accounted) == {"21", "22", "23"}


def test_a_jobs_last_state_is_kept_once_the_scheduler_forgot_it():
    kept = {"7": JobState("7", "RUNNING", "None", "node-1", seen=100.0), "8": JobState("8", "PENDING", "Priority")}
    shown = {"8": JobState("8", "COMPLETED", "None", "node-2")}
    seen = last_seen(shown, {job: state for job, state in kept.items() if job == "7"}, now=200.0)
    assert seen == {"7": kept["7"], "8": JobState("8", "COMPLETED", "None", "node-2", seen=200.0)}
    # as shown now it runs or waits; as kept it is gone: never live again, and said with when
    assert kept["8"].live and not seen["7"].live and not seen["8"].live
    at = time.strftime("%H:%M:%S", time.localtime(100.0))
    assert seen["7"].describe() == f"running on node-1, last seen {at}"


@pytest.mark.parametrize(
    ("gres", "gpus"), [("gpu:2", 2), ("gpu:a100:4(S:0-1)", 4), ("(null)", 0), ("gpu:1,gpu:v100:8", 8), ("shard:4", 0)]
)
def test_the_gpus_of_a_partitions_nodes_are_read_from_sinfo(gres, gpus):
    assert _gpus_per_node(gres) == gpus


def test_the_slurm_region_docs_regions_md_shows_loads_and_asks_for_what_it_says(tmp_path):
    """docs/regions.md's worked example (the README points at it) is a region file as written."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "regions.md").read_text()
    section = docs[docs.index("## A region on a Slurm cluster") :]
    example = re.search(r"```yaml\n(.*?)```", section, flags=re.S)
    assert example is not None
    (tmp_path / "lab.yaml").write_text(example[1])
    (host,) = load_regions(tmp_path / "lab.yaml").regions[0].hosts
    assert host.slurm is not None and host.learners == 4
    script = job_script(host.slurm, "run", "lab-0", "learner", "/runs/run", ["python"], {})
    for option in ("--partition=gpu", "--account=my-project", "--qos=normal", "--time=12:00:00", "--gres=gpu:1",
                   "--cpus-per-task=8", "--mem=64G", "--signal=B:TERM@300", "--constraint=a100"):  # fmt: skip
        assert f"#SBATCH {option}\n" in script, option
    assert "\nmodule load cuda/12.4\n" in script
