"""``diloco status`` in-process: JSON, and a syncer that stopped reporting (plain text when piped
and the live view in a real terminal: tests/integration/test_status_view_terminal.py)."""

import json
import time

from click.testing import CliRunner

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


def test_the_held_out_loss_says_its_version_and_the_base_column_its_meaning(tmp_path):
    """The evaluation lags the merges (version 6's loss at version 7); ``base +behind``:
    the version a learner holds and how far behind it is, said in the header."""
    from diloco_cli.views.status import render_plain

    runs_dir, spec = make_run(tmp_path)
    beat(spec, "local-a-0", 120)
    syncer_status(spec)
    status = collect_status(spec, run_secret(spec))
    assert (status.version, status.heldout_loss, status.heldout_version) == (7, 2.71, 6)
    text = render_plain(status)
    assert "version 7  tokens 245.8k  held-out loss 2.710 (version 6)" in text
    lines = text.splitlines()
    names = next(index for index, line in enumerate(lines) if line.split()[:2] == ["learner", "where"])
    assert lines[names - 1].split() == ["base"] and "+behind" in lines[names].split()  # its two-line header
    as_json = json.loads(runner.invoke(app, ["status", "viewed", "-o", "json", "--runs-dir", str(runs_dir)]).stdout)
    assert as_json["heldout_version"] == 6


def test_a_syncer_whose_supervisor_is_gone_is_down_once_and_restarts_are_the_supervisors(tmp_path):
    runs_dir, spec = make_run(tmp_path)
    for learner in ("local-a-0", "local-b-1"):
        beat(spec, learner, 50)  # local-b-1's heartbeat counts 1 restart, local-a-0's none
    syncer_status(spec)  # a report of a moment ago: running
    supervisors = [
        {
            "process": "syncer",
            "host": "local",
            "ssh": "-",
            "supervisor": "running",
            "supervisor_alive": False,
            "restarts": 0,
        },
        {
            "process": "local-a-0",
            "host": "local",
            "ssh": "-",
            "supervisor": "running",
            "supervisor_alive": True,
            "restarts": 2,
        },  # killed twice before its first heartbeat
        {
            "process": "local-b-1",
            "host": "local",
            "ssh": "-",
            "supervisor": "running",
            "supervisor_alive": True,
            "restarts": 0,
        },  # resumed: a new supervisor counts from 0
    ]
    status = collect_status(spec, run_secret(spec), supervisors)
    assert status.state == "syncer down" and status.syncer.state == "down"
    assert status.problems == [
        "syncer is down (its supervisor is gone); `diloco resume viewed` restarts it",
        "local-a-0 was restarted 2 times after crashes (see `diloco logs viewed local-a-0`)",
    ]
    assert {row.learner: row.restarts for row in status.learners if row.learner in ("local-a-0", "local-b-1")} == {
        "local-a-0": 2,
        "local-b-1": 1,
    }
    from diloco_cli.views.status import render_plain

    text = render_plain(status)
    assert "syncer: down (last report" in text and "syncer: running" not in text


def test_the_scaling_line_says_drained_once_the_drain_ended(tmp_path):
    from diloco_cli.launch.scale import plan_scale
    from diloco_cli.views.run_state import scaling_line

    _, spec = make_run(tmp_path)
    spec = plan_scale(spec, "local-a", -1, now=time.time() - 60)
    assert scaling_line(spec, {"local-a-1": "draining"}, time.time()).endswith("(draining local-a-1)")
    assert scaling_line(spec, {"local-a-1": "drained"}, time.time()).endswith("(drained local-a-1)")


def supervisor_row(process, state="running", restarts=0, crashes=0, last_error=None):
    return {
        "process": process,
        "host": "local",
        "ssh": "-",
        "supervisor": state,
        "supervisor_alive": True,
        "restarts": restarts,
        "crashes": crashes,
        "last_error": last_error,
    }


def test_a_single_kill_is_a_restart_not_a_crash_loop(tmp_path):
    """Issue 31, 7(a): a learner killed once and restarted is not crash-looping."""
    runs_dir, spec = make_run(tmp_path)
    syncer_status(spec)
    rows = [supervisor_row("local-a-0", "restarting", restarts=1, crashes=1, last_error="killed by SIGKILL")]
    status = collect_status(spec, run_secret(spec), rows)
    assert status.problems == [
        "local-a-0 was restarted once after a crash; last error: killed by SIGKILL (see `diloco logs viewed local-a-0`)"
    ]


def test_status_gives_one_restart_count_for_every_process_that_restarts(tmp_path):
    """Issue 32, 8: not "1 crash in a row, restarted 5 times" for one process while every
    supervisor restarts its own: each restarting process once, with the count that
    fits (crashes in a row for a loop, restarts for crashes after a minute's run)."""
    runs_dir, spec = make_run(tmp_path)
    syncer_status(spec)
    rows = [
        supervisor_row("syncer", "running", restarts=5, crashes=0),  # each crash after a minute's run
        supervisor_row("local-a-0", "restarting", restarts=5, crashes=1, last_error="ValueError: no dataset index"),
        supervisor_row("local-a-1", "running", restarts=4, crashes=4, last_error="ValueError: no dataset index"),
        supervisor_row("local-b-0", "running"),
    ]
    problems = collect_status(spec, run_secret(spec), rows).problems
    assert problems == [
        "syncer was restarted 5 times after crashes (see `diloco logs viewed syncer`)",
        "local-a-0 was restarted 5 times after crashes; last error: ValueError: no dataset index "
        "(see `diloco logs viewed local-a-0`)",
        "local-a-1 is crash-looping: it crashed 4 times in a row, each within a minute of its start; last error: "
        "ValueError: no dataset index; see `diloco logs viewed local-a-1`: its supervisor gives up after 10 in a "
        "row, and `diloco resume viewed` starts it again once the cause is fixed",
    ]
    assert not any("in a row, restarted" in problem for problem in problems)


def test_counts_read_as_words_and_piped_lines_never_wrap_mid_phrase(tmp_path):
    """Issue 32, 8: "1 merge", not "1 merges"; the rate says its window, and a finished
    run has none; piped, each line of prose is one line ("grace\\n1.8 s" was two)."""
    from diloco_cli.views.status import render_plain

    runs_dir, spec = make_run(tmp_path)
    beat(spec, "local-a-0", 120)
    syncer_status(spec)
    status = collect_status(spec, run_secret(spec))
    status.syncer.merges, status.syncer.merges_per_minute = 1, 1
    status.syncer.repairs, status.syncer.leftovers_removed = 1, 1
    text = render_plain(status)
    assert "; 1 merge, 1 in the last minute; " in text and "1 merges" not in text
    assert "rewrote 1 damaged published object; removed 1 leftover\n" in text
    syncer_line = next(line for line in text.splitlines() if line.startswith("syncer: running"))
    assert syncer_line.endswith("grace 1.8 s; live 3")  # one line, however long
    assert next(line for line in text.splitlines() if line.startswith("st/s: ")).endswith("rst: restarts")
    status.state = "finished"
    assert "; 1 merge; quorum" in render_plain(status)


def test_a_learner_whose_slurm_job_waits_shows_as_pending_and_one_cancelled_as_down(tmp_path):
    """Issue 33: a learner queued again (requeued and held) is pending with Slurm's reason,
    not the stopped learner its last heartbeat says; a job cancelled from outside is down."""
    runs_dir, spec = make_run(tmp_path)
    syncer_status(spec)
    beat(spec, "local-a-0", 50, state="stopped")  # it checkpointed on the scheduler's signal
    beat(spec, "local-a-1", 50, state="stopped")
    pending = {**supervisor_row("local-a-0", "pending"), "job": "12", "job_state": "pending (JobHeldAdmin)"}
    cancelled = {**supervisor_row("local-a-1", "cancelled"), "supervisor_alive": False, "job": "13"}
    status = collect_status(spec, run_secret(spec), [pending, {**cancelled, "job_state": "cancelled"}])
    states = {row.learner: row.state for row in status.learners}
    assert states["local-a-0"] == "pending (JobHeldAdmin)" and states["local-a-1"] == "stopped"
    assert status.problems == [
        "local-a-0 waits in Slurm's queue: job 12 pending (JobHeldAdmin)",
        "local-a-1 is down (Slurm job 13: cancelled); `diloco resume viewed` restarts it",
    ]
