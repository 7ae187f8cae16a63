"""The command line's front door."""

from typer.testing import CliRunner

from diloco_cli import __version__
from diloco_cli.cli.app import app

runner = CliRunner()


def test_help_states_the_purpose_in_one_sentence():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "Train one PyTorch model across regions and clouds joined only by object storage" in text


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"diloco {__version__}"


def test_commands_that_only_read_buckets_do_not_import_torch():
    """``--help``, ``status``, ``runs``, ``logs``, ``down``, ``report`` and ``up`` load without
    torch (a multi-second import), so they answer at once on any machine; only the
    processes that train or merge import it."""
    import subprocess
    import sys

    modules = [
        "diloco_cli.cli.app",
        "diloco_cli.views.status",
        "diloco_cli.launch.logs",
        "diloco_cli.views.runs",
        "diloco_cli.launch.operations",
        "diloco_cli.views.report",
        "diloco_cli.views.report_html",
        "diloco_cli.bandwidth.prices",
        "diloco_cli.launch.up",
        "diloco_cli.views.dry_run",
        "diloco_cli.views.traffic_plan",
        "diloco_cli.views.preflight",
    ]
    probe = f"import sys; [__import__(m) for m in {modules!r}]; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def made_run(tmp_path):
    """A run on disk that nothing executes (record, secret, manifests)."""
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile
    from diloco_cli.launch.resolve import create_run_directory, resolve_run, write_manifests

    runs_dir = tmp_path / "runs"
    spec = resolve_run(Recipe(), RegionsFile(), "made", runs_dir)
    run_dir, _ = create_run_directory(runs_dir, spec, launcher="local")
    write_manifests(spec)
    return runs_dir, run_dir


def test_bare_diloco_prints_help_and_succeeds():
    result = runner.invoke(app, [])
    assert result.exit_code == 0 and "Commands:" in result.output and "resume" in result.output


def test_help_shows_no_type_after_flags_and_a_readable_prompt_default():
    up = runner.invoke(app, ["up", "--help"]).output
    assert "<bool>" not in up and "<list" not in up and "--set KEY=VALUE" in up
    sample = " ".join(runner.invoke(app, ["sample", "--help"]).output.split())
    assert "[default: (a new line)]" in sample


def test_errors_are_one_line_and_a_nonzero_exit(tmp_path):
    import subprocess
    import sys

    missing = subprocess.run(
        [sys.executable, "-m", "diloco_cli", "status", "--manifest", f"file://{tmp_path}/missing/manifest.json"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert (
        missing.stderr.strip() == f"error: file://{tmp_path}/missing/manifest.json: no such manifest; "
        "a run's is <bucket>/<run>/manifest.json (or runs/<run>/run.json here)"
    )
    bad = runner.invoke(app, ["runs", "--output", "xml"])
    assert bad.exit_code == 2 and "'xml' is not one of 'text', 'json'" in bad.output


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


def test_logs_into_a_closed_pipe_end_quietly_and_follow_ends_with_its_process(tmp_path):
    import subprocess
    import sys

    runs_dir, run_dir = made_run(tmp_path)
    (run_dir / "logs" / "syncer.log").write_text("a line of the syncer's log\n" * 50_000)
    piped = subprocess.run(
        f"{sys.executable} -m diloco_cli logs made syncer --runs-dir {runs_dir} | head -n 1; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0 and piped.stdout == "a line of the syncer's log\n" and piped.stderr == ""
    followed = subprocess.run(
        [sys.executable, "-m", "diloco_cli", "logs", "made", "syncer", "--follow", "--runs-dir", str(runs_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert followed.returncode == 0 and followed.stdout.count("a line") == 50_000  # no process: nothing more will come
