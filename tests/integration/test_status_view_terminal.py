"""``diloco status`` as a user's terminal runs it: plain text when piped, the live view in a
real terminal (tmux), and what is down shown with what to run."""

import json
import shlex
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.codec import RunSecret
from diloco_cli.store.documents import Refusals
from diloco_cli.views.status import LEGEND
from tests.support.runs_on_disk import beat, make_run, run_secret, syncer_status

runner = CliRunner()


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
