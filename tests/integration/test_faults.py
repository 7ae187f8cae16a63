"""Faults in real runs: the syncer killed at random points, a learner killed (an upload cut
short: tests/unit/test_uploads_cut_short.py)."""

import os
import random
import re
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

from diloco_cli.codec import decode_payload
from diloco_cli.launch.runs import load_run
from tests.support.runs import (
    TINY_RECIPE,
    audit_ledger,
    child_pid,
    deep_update,
    diloco,
    wait_finished,
    wait_for,
    write_yaml,
)

pytestmark = pytest.mark.slow


def two_regions(tmp_path, east=1, west=1):
    return write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [{"name": "local", "learners": east}],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [{"name": "local", "learners": west}],
                },
            ]
        },
    )


def pytest_generate_tests(metafunc):
    """The syncer is killed in ``--kill-seeds`` runs, each on its own seeded schedule (CI: one)."""
    if "seed" in metafunc.fixturenames:
        metafunc.parametrize("seed", range(1, 1 + metafunc.config.getoption("--kill-seeds")))


def test_syncer_killed_at_random_points_loses_nothing_and_merges_nothing_twice(tmp_path, seed):
    rng = random.Random(seed)
    runs_dir = tmp_path / "runs"
    recipe = write_yaml(
        tmp_path / "tiny.yaml",
        deep_update(
            TINY_RECIPE,
            {"training": {"num_learners": 3, "inner_steps": 400}},
        ),
    )
    name = f"kill-syncer-{seed}"
    regions = two_regions(tmp_path, east=2)
    up = ("up", str(recipe), "--regions", str(regions), "--name", name, "--runs-dir", str(runs_dir))
    diloco(*up, "--chaos", "keep-payloads")  # the audit reads every payload
    kills, last_version = 0, 0
    while kills < 3:
        # a random point: just after some new version, somewhere in a poll, merge or commit
        status = wait_for(
            runs_dir, name, lambda s, v=last_version: s.version > v or s.state == "finished", 180, "a new version"
        )
        if status.state == "finished":
            break
        last_version = status.version + rng.randint(0, 2)
        time.sleep(rng.uniform(0.0, 1.0))
        if (load_run(runs_dir, name).process_state("syncer") or {}).get("state") != "running":
            break
        os.kill(child_pid(runs_dir, name, "syncer"), signal.SIGKILL)
        kills += 1

        def restarted(_status, expected=kills):
            state = load_run(runs_dir, name).process_state("syncer") or {}
            return state.get("state") == "running" and state.get("restarts") == expected

        wait_for(runs_dir, name, restarted, 60, "the syncer's restart")
    assert kills >= 2
    wait_finished(runs_dir, name, timeout=300)
    record = load_run(runs_dir, name)
    assert record.process_state("syncer")["restarts"] >= kills
    commits, merged = audit_ledger(record.directory, record.secret())
    # every region holds the syncer's final weights, bit for bit
    home = record.spec.home(record.secret())
    newest = {commit.fragment: commit.version for commit in commits}
    syncer_theta = {}
    for version in newest.values():
        for key, tensor in decode_payload(home.read_state(version), record.secret()).tensors.items():
            if key.startswith("theta/"):
                syncer_theta[key[len("theta/") :]] = tensor
    for region in ("east", "west"):
        output = tmp_path / f"{region}.safetensors"
        diloco("export", name, "-o", str(output), "--region", region, "--runs-dir", str(runs_dir))
        exported = load_file(str(output))
        for parameter, tensor in syncer_theta.items():
            assert torch.equal(exported[parameter], tensor), parameter


def test_a_learner_killed_comes_back_from_its_checkpoint(tmp_path):
    runs_dir = tmp_path / "runs"
    # the built-in model (slower than the tiny one), so the kill lands between checkpoints
    recipe = write_yaml(
        tmp_path / "recipe.yaml",
        {
            "training": {
                "num_learners": 2,
                "inner_steps": 40,
                "checkpoint_every_steps": 10,
                "heartbeat_seconds": 0.5,
                "poll_seconds": 0.3,
            },
            "sync": {"sync_interval": 10, "evaluation_batches": 2},
        },
    )
    name = "kill-learner"
    diloco("up", str(recipe), "--regions", str(two_regions(tmp_path)), "--name", name, "--runs-dir", str(runs_dir))

    def checkpointed(status):
        row = next(r for r in status.learners if r.learner == "east-0")
        return 12 <= row.step < 30

    wait_for(runs_dir, name, checkpointed, 180, "east-0 passing its first checkpoint")
    os.kill(child_pid(runs_dir, name, "east-0"), signal.SIGKILL)
    status = wait_finished(runs_dir, name, timeout=300)
    row = next(r for r in status.learners if r.learner == "east-0")
    assert row.restarts == 1 and row.step == 40 and row.state == "finished"
    log = (runs_dir / name / "logs" / "east-0.log").read_text()
    resumed = re.findall(r"resumed from checkpoint at step (\d+)", log)
    assert resumed and int(resumed[0]) >= 10
    assert "exit -9: restarting" in log
