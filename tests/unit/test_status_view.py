"""``diloco status`` in-process: JSON, and a syncer that stopped reporting (plain text when piped
and the live view in a real terminal: tests/integration/test_status_view_terminal.py)."""

import json
import time

from typer.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.views.run_state import collect_status
from tests.support.runs_on_disk import beat, make_run, run_secret, syncer_status

runner = CliRunner()


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


def test_a_silent_syncer_is_reported_with_what_to_run(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    syncer_status(spec)
    status = collect_status(spec, run_secret(spec), now=time.time() + 120)
    assert status.state == "syncer not reporting" and status.syncer.state == "not reporting"
    assert status.problems == [
        "the syncer has not reported for 120 s; if it is down, `diloco resume viewed` restarts it "
        "(`diloco status viewed --probe` asks its host)"
    ]
