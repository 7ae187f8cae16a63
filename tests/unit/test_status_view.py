"""``diloco status``: JSON, plain text when piped, and the live view in a real terminal."""

import json
import shlex
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.codec import RunSecret
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.resolve import create_run_directory, resolve_run, write_manifests
from diloco_cli.store.documents import Evaluation, Head, Heartbeat, LastMerge, Refusals, SyncerStatus
from diloco_cli.store.metering import StorageCounters, Traffic
from diloco_cli.views.run_state import collect_status
from diloco_cli.views.status import LEGEND

runner = CliRunner()


def make_run(tmp_path, name="viewed"):
    runs_dir = tmp_path / "runs"
    spec = resolve_run(Recipe(), RegionsFile(), name, runs_dir)
    _, SECRETS[spec.run] = create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    return runs_dir, spec


def beat(spec, learner, step, state="training", loss=2.5, secret=None):
    region = spec.learner(learner).region
    bucket = spec.bucket(region, secret or run_secret(spec))
    bucket.write_heartbeat(
        Heartbeat(
            learner=learner,
            region=region,
            host="local",
            pid=1,
            state=state,
            step=step,
            total_steps=400,
            tokens=step * 2048,
            loss=loss,
            step_seconds=0.5,
            base_versions={0: 3, 1: 4},
            restarts=1 if learner == "local-b-1" else 0,
            epoch=1,
            storage=StorageCounters(
                kinds={
                    "payload": Traffic(bytes_up=1_500_000, bytes_down=300_000),
                    "checkpoint": Traffic(bytes_up=9_000_000),
                },
                retries=2,
            ),
            started_at=0.0,
            time=time.time(),
        )
    )


SECRETS = {}


def run_secret(spec):
    return SECRETS[spec.run]


def syncer_status(spec, state="running", reason="grace window: 1.8 s left for 2 more learners (2 arrived)"):
    now = time.time()
    status = SyncerStatus(
        state=state,
        run=spec.run,
        version=7,
        fragment_versions={0: 6, 1: 7},
        snapshot_version=0,
        merges=7,
        merges_per_minute=3,
        last_merge=LastMerge(fragment=1, version=7, learners=["local-a-0", "local-b-0"], seconds=0.2, time=now - 3),
        quorum=4,
        effective_quorum=3,
        grace_seconds=1.8,
        live_learners=["local-a-0", "local-a-1", "local-b-0"],
        reasons={0: reason, 1: "1 of K=3 arrived; waiting"},
        evaluations=[
            Evaluation(version=0, loss=5.5, tokens=0, time=now),
            Evaluation(version=6, loss=2.71, tokens=400000, time=now),
        ],
        storage={
            "local-a": StorageCounters(
                kinds={"update": Traffic(bytes_up=2_000_000), "payload": Traffic(bytes_down=900_000)}
            ),
            "local-b": StorageCounters(
                kinds={"update": Traffic(bytes_up=2_000_000), "payload": Traffic(bytes_down=800_000)}, retries=5
            ),
        },
        started_at=now - 100,
        time=now,
    )
    for bucket in spec.buckets(run_secret(spec)):
        bucket.write_syncer_status(status)
        bucket.write_head(Head(version=7, fragment_versions={0: 6, 1: 7}, snapshot_version=0, recent=(), recent_from=0))


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
    assert (
        row["learner"] == "local-b-1"
        and row["restarts"] == 1
        and row["staleness"] == 4
        and row["steps_per_second"] == 2.0
    )
    assert status["syncer"]["reasons"]["0"].startswith("grace window: 1.8 s left")
    assert {r["region"]: r["learners_up"] for r in status["regions"]} == {
        "local-a": 3_000_000,
        "local-b": 3_000_000,
    }  # checkpoints apart
    assert {r["region"]: r["checkpoints_up"] for r in status["regions"]} == {
        "local-a": 18_000_000,
        "local-b": 18_000_000,
    }
    for field in ("last_seen_seconds", "base_version", "bytes_down"):
        assert field in row


def test_piped_output_is_plain_text(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    beat(spec, "local-a-0", 50)
    syncer_status(spec)
    result = subprocess.run(
        [sys.executable, "-m", "diloco_cli", "status", "viewed", "--runs-dir", str(runs_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout  # no terminal escapes when piped
    assert "run viewed  running  version 7" in result.stdout
    assert "local-a-0" in result.stdout and "50/400" in result.stdout and "not started" in result.stdout
    assert "3 +4" in result.stdout  # base version and staleness
    assert "fragment 0: grace window: 1.8 s left for 2 more learners" in result.stdout


def tmux(*arguments):
    return subprocess.run(["tmux", *arguments], capture_output=True, text=True)


@pytest.mark.parametrize("columns", [80, 160])
def test_live_view_in_a_real_terminal_updates_and_ends_with_the_run(tmp_path, columns):
    runs_dir, spec = make_run(tmp_path)
    for learner in ("local-a-0", "local-a-1", "local-b-0", "local-b-1"):
        beat(spec, learner, 10)
    syncer_status(spec)
    session = f"diloco-status-{time.monotonic_ns()}"
    command = (
        f"env -u COLUMNS -u LINES {shlex.quote(sys.executable)} -m diloco_cli status viewed --watch "
        f"--runs-dir {shlex.quote(str(runs_dir))}; echo VIEW-ENDED; sleep 30"
    )
    assert tmux("new-session", "-d", "-s", session, "-x", str(columns), "-y", "40", command).returncode == 0
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
        assert "run viewed" in first and "grace window: 1.8 s left" in first and "local-b-1" in first
        assert "fragment 0: grace window" in first and "for fragment 0" not in first  # said once
        words = " ".join(first.split())
        assert "K=4, lowered to 3 while only 3 live" in words and "(fragment 1, 2 learners)" in words, first
        assert max(len(line.rstrip()) for line in first.splitlines()) <= columns
        assert "600.0 kB" in first and "checkpoints" in first  # the region table fits: no value or header cut
        if columns >= 160:  # the legend is one line where there is room
            assert LEGEND in first
        else:
            assert LEGEND in words
        colours = tmux("capture-pane", "-p", "-e", "-t", session).stdout
        assert "\x1b[" in colours  # a real terminal gets the rich view
        beat(spec, "local-a-0", 77)
        wait_screen("77/400")
        for learner in ("local-a-0", "local-a-1", "local-b-0", "local-b-1"):
            beat(spec, learner, 400, state="finished")
        syncer_status(spec, state="finished", reason="no arrivals yet")
        final = wait_screen("VIEW-ENDED")
        assert "finished" in final
        assert "lowered to" not in " ".join(final.split())  # a finished run waits for nobody
    finally:
        tmux("kill-session", "-t", session)


def test_refusals_retries_and_what_is_down_are_shown_with_what_to_run(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    beat(spec, "local-a-0", 120)
    refusals = Refusals()
    refusals.record(
        "update",
        "global/updates/0000000006-000.dlc",
        "tag mismatch: the payload was altered or forged",
        time.time() - 5,
    )
    bucket = spec.bucket("local-a", run_secret(spec))
    bucket.write_heartbeat(bucket.read_heartbeat("local-a-0").model_copy(update={"refusals": refusals}))
    # a heartbeat forged with another run's key is refused by status too
    spec.bucket("local-b", RunSecret(bytes(32))).write_heartbeat(
        bucket.read_heartbeat("local-a-0").model_copy(update={"learner": "local-b-0", "region": "local-b"})
    )
    syncer_status(spec)
    # the syncer's supervisor gave up (its process is long gone)
    (runs_dir / "viewed" / "processes" / "syncer.json").write_text(
        json.dumps({"state": "failed", "exit_code": 1, "restarts": 9, "supervisor_pid": 999999999})
    )
    record = json.loads((runs_dir / "viewed" / "run.json").read_text())
    record["processes"] = [{"name": "syncer", "kind": "syncer", "pid": 999999999, "host": "local"}]
    (runs_dir / "viewed" / "run.json").write_text(json.dumps(record))
    result = runner.invoke(app, ["status", "viewed", "--output", "json", "--runs-dir", str(runs_dir)])
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    regions = {r["region"]: r for r in status["regions"]}
    assert regions["local-a"]["refusals"] == {"update": 1}
    assert regions["local-a"]["latest_refusal"]["key"] == "global/updates/0000000006-000.dlc"
    assert regions["local-b"]["refusals"] == {"heartbeat": 1} and regions["local-b"]["retries"] == 5
    assert regions["local-a"]["retries"] == 2
    assert any(
        "syncer is down: its supervisor gave up" in p and "diloco resume viewed" in p for p in status["problems"]
    ), status["problems"]
    text = subprocess.run(
        [sys.executable, "-m", "diloco_cli", "status", "viewed", "--runs-dir", str(runs_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "! syncer is down: its supervisor gave up" in text.stdout
    assert "refused in local-a: 1 update; latest update global/updates/0000000006-000.dlc" in text.stdout
    assert "tag mismatch" in text.stdout


def test_a_silent_syncer_is_reported_with_what_to_run(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    syncer_status(spec)
    status = collect_status(spec, run_secret(spec), now=time.time() + 120)
    assert status.state == "syncer not reporting" and status.syncer.state == "not reporting"
    assert status.problems == [
        "the syncer has not reported for 120 s; if it is down, `diloco resume viewed` restarts it "
        "(`diloco status viewed --probe` asks its host)"
    ]
