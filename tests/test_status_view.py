"""``diloco status``: JSON, plain text when piped, and the live view in a real terminal."""

import json
import shlex
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.plan import create_run_directory, plan_run, write_manifests

runner = CliRunner()


def make_run(tmp_path, name="viewed"):
    runs_dir = tmp_path / "runs"
    spec = plan_run(Recipe(), RegionsFile(), name, runs_dir)
    create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    return runs_dir, spec


def beat(spec, learner, step, state="training", loss=2.5):
    region = spec.learner(learner).region
    bucket = spec.bucket(region, None)
    bucket.write_heartbeat(
        learner,
        {"learner": learner, "state": state, "step": step, "total_steps": 400, "tokens": step * 2048, "loss": loss,
         "step_seconds": 0.5, "base_versions": {"0": 3, "1": 4}, "restarts": 1 if learner == "local-b-1" else 0,
         "bytes_up": 1_500_000, "bytes_down": 300_000, "time": time.time()},
    )


def syncer_status(spec, state="running", reason="grace window: 1.8 s left for 2 more learners on fragment 0 (2 arrived)"):
    status = {
        "state": state, "version": 7, "merges": 7, "merges_per_minute": 3,
        "last_merge": {"fragment": 1, "version": 7, "learners": ["local-a-0", "local-b-0"], "seconds": 0.2, "time": time.time() - 3},
        "quorum": 4, "effective_quorum": 3, "grace_seconds": 1.8, "live_learners": ["local-a-0", "local-a-1", "local-b-0"],
        "reasons": {"0": reason, "1": "1 of K=3 arrived for fragment 1; waiting"},
        "evaluations": [{"version": 0, "loss": 5.5, "tokens": 0, "time": time.time()}, {"version": 6, "loss": 2.71, "tokens": 400000, "time": time.time()}],
        "bytes": {"local-a": {"up": 2_000_000, "down": 900_000}, "local-b": {"up": 2_000_000, "down": 800_000}},
        "time": time.time(),
    }
    for bucket in spec.buckets(None):
        bucket.write_syncer_status(status)
        bucket.write_head({"version": 7, "fragment_versions": {"0": 6, "1": 7}, "snapshot_version": 0, "recent": [], "recent_from": 0})


def test_json_output_carries_every_documented_field(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    for learner in ("local-a-0", "local-a-1", "local-b-0", "local-b-1"):
        beat(spec, learner, 120)
    syncer_status(spec)
    result = runner.invoke(app, ["status", "viewed", "--output", "json", "--runs-dir", str(runs_dir)])
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    assert status["state"] == "running" and status["version"] == 7 and status["heldout_loss"] == 2.71
    assert status["tokens"] == 4 * 120 * 2048
    row = status["learners"][3]
    assert row["learner"] == "local-b-1" and row["restarts"] == 1 and row["staleness"] == 4 and row["steps_per_second"] == 2.0
    assert status["syncer"]["reasons"]["0"].startswith("grace window: 1.8 s left")
    assert {r["region"]: r["learners_up"] for r in status["regions"]} == {"local-a": 3_000_000, "local-b": 3_000_000}
    for field in ("last_seen_seconds", "base_version", "bytes_down"):
        assert field in row


def test_piped_output_is_plain_text(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    beat(spec, "local-a-0", 50)
    syncer_status(spec)
    result = subprocess.run([sys.executable, "-m", "diloco_cli", "status", "viewed", "--runs-dir", str(runs_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout  # no terminal escapes when piped
    assert "run viewed  running  version 7" in result.stdout
    assert "local-a-0" in result.stdout and "50/400" in result.stdout and "not started" in result.stdout
    assert "3 +4" in result.stdout  # base version and staleness
    assert "fragment 0: grace window: 1.8 s left for 2 more learners" in result.stdout


def tmux(*arguments):
    return subprocess.run(["tmux", *arguments], capture_output=True, text=True)


def test_live_view_in_a_real_terminal_updates_and_ends_with_the_run(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    for learner in ("local-a-0", "local-a-1", "local-b-0", "local-b-1"):
        beat(spec, learner, 10)
    syncer_status(spec)
    session = f"diloco-status-{time.monotonic_ns()}"
    command = f"env -u COLUMNS -u LINES {shlex.quote(sys.executable)} -m diloco_cli status viewed --watch --runs-dir {shlex.quote(str(runs_dir))}; echo VIEW-ENDED; sleep 30"
    assert tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "40", command).returncode == 0
    try:
        def screen():
            return tmux("capture-pane", "-p", "-t", session).stdout

        def wait_screen(text, timeout=60):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if text in screen():
                    return screen()
                time.sleep(0.3)
            raise AssertionError(f"{text!r} never appeared on the terminal:\n{screen()}")

        first = wait_screen("10/400")
        assert "run viewed" in first and "grace window: 1.8 s left" in first and "learners" in first
        colours = tmux("capture-pane", "-p", "-e", "-t", session).stdout
        assert "\x1b[" in colours  # a real terminal gets the rich view
        beat(spec, "local-a-0", 77)
        wait_screen("77/400")
        for learner in ("local-a-0", "local-a-1", "local-b-0", "local-b-1"):
            beat(spec, learner, 400, state="finished")
        syncer_status(spec, state="finished", reason="no arrivals for fragment 0 yet")
        final = wait_screen("VIEW-ENDED")
        assert "finished" in final
    finally:
        tmux("kill-session", "-t", session)
