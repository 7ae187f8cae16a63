"""The command line's front door, in-process (in processes of its own:
tests/integration/test_cli_processes.py)."""

from click.testing import CliRunner

from diloco_cli import __version__
from diloco_cli.cli.app import app
from tests.support.runs_on_disk import made_run

runner = CliRunner()


def test_help_states_the_purpose_in_one_sentence():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "Train one PyTorch model across regions and clouds joined only by object storage" in text


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"diloco {__version__}"


def test_bare_diloco_prints_help_and_succeeds():
    result = runner.invoke(app, [])
    assert result.exit_code == 0 and "Commands:" in result.output and "resume" in result.output


def test_help_shows_no_type_after_flags_and_a_readable_prompt_default():
    up = runner.invoke(app, ["up", "--help"]).output
    assert "<bool>" not in up and "<list" not in up and "--set KEY=VALUE" in up
    sample = " ".join(runner.invoke(app, ["sample", "--help"]).output.split())
    assert "[default: (a new line)]" in sample


def test_runs_says_a_run_that_never_ran_is_down_and_lists_json(tmp_path):
    import json

    runs_dir, run_dir = made_run(tmp_path)
    record = json.loads((run_dir / "run.json").read_text())
    record["processes"] = [{"name": "syncer", "kind": "syncer", "pid": 999999999, "host": "local"}]
    (run_dir / "run.json").write_text(json.dumps(record))
    (run_dir / "processes" / "syncer.json").write_text(json.dumps({"state": "finished"}))
    listed = json.loads(runner.invoke(app, ["runs", "-o", "json", "--runs-dir", str(runs_dir)]).output)
    assert [(r["name"], r["state"], r["learners"]) for r in listed] == [("made", "finished", 4)]
    (run_dir / "processes" / "syncer.json").write_text(json.dumps({"state": "running"}))  # but its process is gone
    assert "made" in (text := runner.invoke(app, ["runs", "--runs-dir", str(runs_dir)]).output) and " down " in text


def test_rm_older_than_from_cron_has_nothing_to_remove_most_days(tmp_path):
    """The README's ``diloco rm --older-than 7``: no run old enough is a quiet success;
    a negative age is refused."""
    import json

    runs_dir, run_dir = made_run(tmp_path)
    (run_dir / "processes" / "syncer.json").write_text(json.dumps({"state": "finished"}))
    record = json.loads((run_dir / "run.json").read_text())
    record["processes"] = [{"name": "syncer", "kind": "syncer", "pid": 999999999, "host": "local"}]
    (run_dir / "run.json").write_text(json.dumps(record))
    recent = runner.invoke(app, ["rm", "--older-than", "7", "--runs-dir", str(runs_dir)])
    assert recent.exit_code == 0, recent.output
    assert recent.stdout == f"nothing to remove: no finished or stopped run in {runs_dir} is older than 7 days\n"
    assert run_dir.exists()
    negative = runner.invoke(app, ["rm", "--older-than", "-1", "--runs-dir", str(runs_dir)])
    assert negative.exit_code == 2 and "'-1': expected a finite number >= 0" in negative.stderr
    everything = runner.invoke(app, ["rm", "--older-than", "0", "--runs-dir", str(runs_dir)])
    assert everything.exit_code == 0 and everything.stdout.startswith("removed run made: ") and not run_dir.exists()


def test_down_on_a_finished_run_says_finished_as_runs_does(tmp_path):
    import json

    runs_dir, run_dir = made_run(tmp_path)
    record = json.loads((run_dir / "run.json").read_text())
    record["processes"] = [{"name": "syncer", "kind": "syncer", "pid": 999999999, "host": "local"}]
    (run_dir / "run.json").write_text(json.dumps(record))
    (run_dir / "processes" / "syncer.json").write_text(json.dumps({"state": "finished"}))
    down = runner.invoke(app, ["down", "made", "--runs-dir", str(runs_dir)])
    assert down.exit_code == 0 and down.stdout.splitlines()[-1] == "run made is finished: nothing of it was running"
    listed = runner.invoke(app, ["runs", "--runs-dir", str(runs_dir)]).stdout
    assert " finished " in listed


def test_runs_and_status_say_the_same_where_no_run_was_started(tmp_path):
    runs_dir = tmp_path / "runs"
    said = f"no runs in {runs_dir}; start one with `diloco up`\n"
    for command in ("runs", "status"):
        result = runner.invoke(app, [command, "--runs-dir", str(runs_dir)])
        assert (result.exit_code, result.stdout) == (0, said), command
    as_json = runner.invoke(app, ["status", "-o", "json", "--runs-dir", str(runs_dir)])
    assert (as_json.exit_code, as_json.stdout, as_json.stderr) == (0, "null\n", said)


def test_a_ctrl_c_that_pydantic_wraps_while_a_command_writes_json_is_one_line_and_exit_130(monkeypatch):
    """A KeyboardInterrupt raised inside pydantic's serializer comes out as a
    PydanticSerializationError; every command says "interrupted" and exits 130 for it, as
    for any Ctrl-C, instead of a traceback (here `simulate goodput -o json`, whose grid
    pydantic writes)."""
    from pydantic_core import PydanticSerializationError

    from diloco_cli.simulate.grid import GoodputGrid
    from tests.support.interrupts import pydantic_wrapped_interrupt, raise_wrapped_interrupt

    error = pydantic_wrapped_interrupt()  # what pydantic does
    assert isinstance(error, PydanticSerializationError) and "KeyboardInterrupt" in str(error)
    arguments = ["simulate", "goodput", "-n", "150k", "-m", "1", "-o", "json"]
    assert CliRunner().invoke(app, arguments).exit_code == 0
    monkeypatch.setattr(GoodputGrid, "model_dump_json", raise_wrapped_interrupt)
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 130 and result.stderr.strip() == "interrupted", result.output
