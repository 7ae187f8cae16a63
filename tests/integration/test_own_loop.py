"""A user's own training loop as a learner: `diloco_cli.join` in a plain PyTorch loop and
`DilocoCallback` in a Hugging Face Trainer, each run by `diloco up` from the recipe's
`training.entry_point` and held to the same ledger as the built-in loop."""

import json
import math
import os
import re
import shlex
import shutil
import signal
import time
from pathlib import Path

import pytest

from diloco_cli.launch.runs import load_run
from tests.support.runs import (
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    child_pid,
    diloco,
    heartbeats,
    wait_finished,
    write_yaml,
)

ROOT = Path(__file__).resolve().parents[2]
FAST = {
    "training": {
        "num_learners": 2,
        "inner_steps": 60,
        "heartbeat_seconds": 0.5,
        "poll_seconds": 0.3,
        "checkpoint_every_steps": 25,
    },
    "sync": {
        "sync_interval": 10,
        "snapshot_every": 3,
        "evaluate_every": 2,
        "evaluation_batches": 2,
        "poll_seconds": 0.2,
    },
}


def overrides(changes: dict, prefix: str = "") -> list[str]:
    """``--set KEY=VALUE`` arguments for a nested dict of recipe changes."""
    arguments = []
    for key, value in changes.items():
        if isinstance(value, dict):
            arguments += overrides(value, f"{prefix}{key}.")
        else:
            arguments += ["--set", f"{prefix}{key}={json.dumps(value)}"]
    return arguments


def two_regions(tmp_path: Path) -> Path:
    regions = [
        {"name": name, "bucket": f"file://{tmp_path}/buckets/{name}", "hosts": [{"name": "local", "learners": 1}]}
        for name in ("east", "west")
    ]
    return write_yaml(tmp_path / "regions.yaml", {"regions": regions})


def run_example(tmp_path: Path, recipe: str, name: str) -> Path:
    runs_dir = tmp_path / "runs"
    diloco(
        "up",
        recipe,
        "--regions",
        str(two_regions(tmp_path)),
        "--name",
        name,
        "--runs-dir",
        str(runs_dir),
        *overrides(FAST),
        cwd=ROOT,
    )
    wait_finished(runs_dir, name, timeout=300)
    return runs_dir


def assert_a_good_run(runs_dir: Path, name: str) -> None:
    beats = heartbeats(runs_dir, name)
    assert all(beat.step == FAST["training"]["inner_steps"] and beat.loss is not None for beat in beats.values()), beats
    assert_every_token_accounted(runs_dir, name, beats)
    assert_bases_are_the_syncers(runs_dir, name)
    status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    losses = [evaluation["loss"] for evaluation in status["evaluations"]]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_a_plain_pytorch_loop_is_a_learner(tmp_path):
    runs_dir = run_example(tmp_path, "examples/plain-loop.yaml", "plain")
    assert_a_good_run(runs_dir, "plain")
    log = (runs_dir / "plain" / "logs" / "east-0.log").read_text()
    assert "finished at step 60" in log


@pytest.mark.slow
def test_a_hugging_face_trainer_is_a_learner(tmp_path):
    runs_dir = run_example(tmp_path, "examples/hf-trainer.yaml", "trainer")
    assert_a_good_run(runs_dir, "trainer")


def test_a_missing_entry_point_is_refused_before_anything_starts(tmp_path):
    recipe = write_yaml(tmp_path / "recipe.yaml", {"training": {"entry_point": "no/such/train.py"}})
    result = diloco("up", str(recipe), "--dry-run", "--runs-dir", str(tmp_path / "runs"), check=False, cwd=tmp_path)
    assert result.returncode != 0 and "training.entry_point 'no/such/train.py': no such file" in result.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def documented_command(example: Path) -> list[str]:
    """The command an example's recipe gives in its header (``#   diloco up ...``); its
    script and docs/your-own-loop.md give the same one."""
    line = next(line for line in example.read_text().splitlines() if line.startswith("#   diloco "))
    command = line.removeprefix("#").strip()
    script = ROOT / "examples" / (example.stem.replace("-", "_") + ".py")
    assert f"`{command}`" in script.read_text()
    return shlex.split(command)


STARTING = re.compile(r"starting at step (\d+), learning rate (\S+)")


@pytest.mark.slow
@pytest.mark.parametrize("example", ["plain-loop", "hf-trainer"])
def test_each_example_runs_as_documented_and_its_schedule_resumes_where_it_was(tmp_path, example):
    """The example's own command, in a directory holding the examples as the repository
    does, with the default regions; one learner is killed after its first checkpoint and
    comes back at that step with the learning rate of that step, not of step 0."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    command = documented_command(ROOT / "examples" / f"{example}.yaml")
    assert command[:2] == ["diloco", "up"]
    started = diloco(*command[1:], cwd=tmp_path, timeout=300)
    name = re.search(r"started run ([a-z0-9-]+)", started.stdout).group(1)
    runs_dir = tmp_path / "runs"
    record = load_run(runs_dir, name)
    bucket = record.spec.bucket("local-a", record.secret())
    deadline = time.monotonic() + 600
    while not bucket.checkpoint_keys("local-a-0"):
        assert time.monotonic() < deadline, "no checkpoint in ten minutes"
        time.sleep(0.5)
    os.kill(child_pid(runs_dir, name, "local-a-0"), signal.SIGKILL)
    wait_finished(runs_dir, name, timeout=900)
    log = (runs_dir / name / "logs" / "local-a-0.log").read_text()
    starts = [(int(step), float(rate)) for step, rate in STARTING.findall(log)]
    assert len(starts) == 2 and starts[0][0] == 0 and starts[1][0] == 100, starts  # checkpoint_every_steps: 100
    if example == "plain-loop":  # 3e-3 after 20 warmup steps, cosine to 0 at step 200
        assert starts[1][1] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 80 / 180)), rel=1e-4)
    else:  # the Trainer's default: linear from 3e-3 after 10 warmup steps to 0 at max_steps 10,000
        assert starts[1][1] == pytest.approx(3e-3 * (10_000 - 100) / (10_000 - 10), rel=1e-4)
    assert all(beat.step == 200 for beat in heartbeats(runs_dir, name).values())
    assert_bases_are_the_syncers(runs_dir, name)
