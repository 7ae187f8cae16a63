"""Faults: uploads cut short, the syncer killed at random points, a learner killed."""

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco_cli.codec import decode_payload
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.core import decisions
from diloco_cli.launch.resolve import resolve_run
from diloco_cli.launch.runs import load_run
from diloco_cli.runtime.syncer.loop import Syncer
from diloco_cli.store.region import PAYLOAD_KEY
from tests.support.runs import TINY_RECIPE, child_pid, deep_update, diloco, wait_finished, wait_for, write_yaml

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


def test_a_payload_without_its_marker_is_never_read(tmp_path, secret):
    recipe = Recipe.model_validate(TINY_RECIPE)
    regions = RegionsFile.model_validate(
        {"regions": [{"name": "east", "bucket": f"file://{tmp_path}/east", "hosts": [{"learners": 2}]}]}
    )
    spec = resolve_run(recipe, regions, "unmarked", tmp_path)
    syncer = Syncer(spec, secret)
    syncer.start()
    bucket = syncer.buckets["east"]
    payload = bucket.store.get("global/snapshots/0000000000.dlc")  # any authentic payload
    key = "payloads/east-0/000-000001000001.dlc"
    bucket.store.put(key, payload[: len(payload) // 2])  # an upload killed midway: no marker
    (Path(tmp_path) / "east" / "payloads" / "east-1").mkdir(parents=True)
    (Path(tmp_path) / "east" / "payloads" / "east-1" / "000-000001000001.dlc.ab12.partial").write_bytes(b"half")
    for _ in range(3):
        assert not [
            o
            for o in syncer.observer.look(spec, read_heartbeats=False).observations
            if isinstance(o, decisions.ArrivalSeen)
        ]
    assert bucket.payload_keys() == []
    # once the upload completes (payload whole, then marker) it is seen
    meta = {"base_version": 0, "c_steps": 10, "c_tokens": 100}
    bucket.send_payload("east-0", 0, 1000002, payload, meta)
    seen = [
        o
        for o in syncer.observer.look(spec, read_heartbeats=False).observations
        if isinstance(o, decisions.ArrivalSeen)
    ]
    assert [o.arrival.key for o in seen] == ["east:payloads/east-0/000-000001000002.dlc"]


def audit_ledger(run_dir: Path, secret):
    """Every arrival merged at most once; every payload sent merged or superseded by a
    newer merged one of the same learner and fragment; each learner's last send merged."""
    record = load_run(run_dir.parent, run_dir.name)
    commits = record.spec.home(secret).history()
    assert [c.version for c in commits] == list(range(1, len(commits) + 1))
    merged = [m.key for c in commits for m in c.merged]
    retired = [r.key for c in commits for r in c.retired]
    assert len(merged) == len(set(merged)), "an arrival was merged twice"
    assert not set(merged) & set(retired)
    assert len(retired) == len(set(retired))
    newest_merged: dict[tuple[str, int], int] = {}
    for key in merged:
        match = PAYLOAD_KEY.match(key.split(":", 1)[1])
        slot = (match["learner"], int(match["fragment"]))
        newest_merged[slot] = max(newest_merged.get(slot, -1), int(match["sequence"]))
    sent: dict[tuple[str, int], list[int]] = {}
    for bucket in record.spec.buckets(secret):
        for key in bucket.payload_keys():  # nothing was deleted: delete_consumed_payloads is off
            match = PAYLOAD_KEY.match(key)
            sent.setdefault((match["learner"], int(match["fragment"])), []).append(int(match["sequence"]))
    assert sent, "no payloads were sent"
    for slot, sequences in sent.items():
        assert slot in newest_merged, f"nothing of {slot} was ever merged"
        assert max(sequences) == newest_merged[slot], f"the last send of {slot} was lost"
        for sequence in sequences:
            assert sequence <= newest_merged[slot]
    return commits, merged


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
            {"training": {"num_learners": 3, "inner_steps": 400}, "sync": {"delete_consumed_payloads": False}},
        ),
    )
    name = f"kill-syncer-{seed}"
    diloco(
        "up", str(recipe), "--regions", str(two_regions(tmp_path, east=2)), "--name", name, "--runs-dir", str(runs_dir)
    )
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
