"""The command line's front door, as a user's shell runs it: in a process of its own (what it
imports, its errors, its output into a closed pipe)."""

import os

import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from tests.support.runs_on_disk import made_run

runner = CliRunner()


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


def test_the_executable_loads_nothing_before_it_can_answer_a_ctrl_c():
    """The entry point pip's ``diloco`` script imports is a module of a few lines: click and
    the commands load inside its ``try``, so a Ctrl-C while they load is its one line."""
    import subprocess
    import sys

    entry = "import sys, diloco_cli.cli.entry; print(sorted(m for m in ('click', 'pydantic') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", entry], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


HEAVY = ("torch", "typer", "numpy", "yaml", "paramiko", "pydantic", "fsspec", "rich", "diloco_cli.runtime")
"""What a command that only reads must not import, each a multiple of a bare interpreter's
start (issue 32): torch seconds, typer (it converted every parameter through pydantic) 6-7x,
numpy 2x, paramiko (SSH) 3x, pydantic and fsspec each about 1x."""
STATUS_NEEDS = {"status": ("pydantic", "rich"), "status --output json": ("pydantic",)}
"""``status`` reads a run's documents as pydantic models and draws with rich (its JSON
draws nothing); a local run's buckets are folders, read without fsspec."""
STATUS_NEVER = (
    "diloco_cli.bandwidth.model",
    "diloco_cli.bandwidth.shapes",
    "diloco_cli.bandwidth.prices",
    "diloco_cli.store.home",
    "diloco_cli.launch.services",
    "diloco_cli.config.regions",
)
"""What ``status`` of a local run does not use, each a module of pydantic models to build:
the traffic model (its bandwidth line is bytes, unpriced), the syncer's home records, and
what starts processes (their devices, the region file)."""


@pytest.mark.parametrize("command", ["--help", "status", "status --output json", "runs", "logs"])
def test_commands_that_only_read_import_only_what_they_need(tmp_path, command):
    """``diloco --help``, ``status RUN``, ``runs`` and ``logs RUN syncer`` in a process of their
    own, as a user's shell runs them: none imports torch, typer, numpy, yaml or paramiko;
    ``--help``, ``runs`` and ``logs`` not pydantic, fsspec or rich either, ``status`` none of
    :data:`STATUS_NEVER`, not fsspec (its buckets are local folders) and, for JSON, not rich."""
    import json
    import subprocess
    import sys

    run = made_run(tmp_path)[1].name
    arguments = {
        "--help": ["--help"],
        "status": ["status", run],
        "status --output json": ["status", run, "--output", "json"],
        "runs": ["runs"],
        "logs": ["logs", run, "syncer"],
    }
    probe = (
        "import sys; sys.argv = ['diloco', *sys.argv[1:]]\n"
        "from diloco_cli.cli.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import json; print('LOADED', json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *arguments[command]], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    loaded = json.loads(result.stdout.rsplit("LOADED", 1)[1])
    forbidden = [m for m in HEAVY if m not in STATUS_NEEDS.get(command, ())]
    if command.startswith("status"):
        forbidden += STATUS_NEVER
    assert [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)] == [], result.stderr
    if command == "status":
        assert f"run {run}" in result.stdout, result.stdout + result.stderr
    if command == "status --output json":
        assert json.loads(result.stdout.rsplit("LOADED", 1)[0])["run"] == run, result.stdout + result.stderr


def test_plan_given_the_step_loads_torch_and_no_storage(tmp_path):
    """``diloco plan --step-seconds S`` builds the model and sizes its payloads with the
    real encoder (torch), and names keys and protocols of the store without opening a
    bucket: no fsspec (with asyncio, 90 ms of CPU), no tenacity, no yaml, no SSH, no
    runtime (issue 32: it answers within 2 s)."""
    import json
    import subprocess
    import sys

    probe = (
        "import sys; sys.argv = ['diloco', 'plan', '--step-seconds', '1']\n"
        "from diloco_cli.cli.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import json; print('LOADED', json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    loaded = json.loads(result.stdout.rsplit("LOADED", 1)[1])
    assert "torch" in loaded and "smallest H" in result.stdout, result.stdout + result.stderr
    forbidden = ("fsspec", "tenacity", "yaml", "paramiko", "typer", "diloco_cli.runtime")
    assert [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)] == [], result.stderr


@pytest.mark.parametrize("command", ["runs", "_probe"])
def test_a_command_leaves_the_interpreters_last_collection_nothing_to_walk(tmp_path, command):
    """What a command imported is frozen when it ends (``gc.freeze``): the interpreter's last
    collection would otherwise walk every object of torch (0.4 s of CPU after
    ``diloco plan``) or of pydantic (50 ms after ``status``) only to exit.  A run's own
    processes (``_learner``, ``_syncer``, ``_probe``...; a learner may run the user's
    script) exit as Python does."""
    import subprocess
    import sys

    arguments = {"runs": ["runs"], "_probe": ["_probe", "--url", f"file://{tmp_path}/bucket"]}[command]
    probe = (
        f"import atexit, gc, sys; sys.argv = ['diloco', *{arguments!r}]\n"
        "atexit.register(lambda: print('FROZEN', gc.get_freeze_count()))\n"
        "from diloco_cli.cli.entry import main\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    frozen = int(result.stdout.rsplit("FROZEN", 1)[1])
    assert (frozen > 10_000) if command == "runs" else (frozen == 0), result.stdout + result.stderr


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


def test_logs_and_status_into_a_pipe_closed_early_exit_0_every_time(tmp_path):
    """``diloco logs RUN | head -3`` and ``diloco status | head -3``: the reader leaves
    before the writer is done (or, with ``true``, before it starts); that is success."""
    import subprocess
    import sys

    runs_dir, run_dir = made_run(tmp_path)
    for process in ("syncer", "local-a-0", "local-a-1", "local-b-0", "local-b-1"):
        (run_dir / "logs" / f"{process}.log").write_text(f"a line of {process}'s log\n" * 20_000)
    for command in ("logs made", "status made"):
        for reader in ["head -n 3"] * 20 + ["true"]:
            piped = subprocess.run(
                f"{sys.executable} -m diloco_cli {command} --runs-dir {runs_dir} | {reader}; exit ${{PIPESTATUS[0]}}",
                shell=True,
                executable="/bin/bash",
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert (piped.returncode, piped.stderr) == (0, ""), (command, reader, piped.stderr[-2000:])
            assert len(piped.stdout.splitlines()) == (3 if reader.startswith("head") else 0)


def test_a_usage_mistake_is_one_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "diloco_cli", "sample", "made", "-n", "nan"], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "error: diloco sample: Invalid value for '--length' / '-n': Input should be a valid integer, unable to parse "
        "string as an integer (`diloco sample --help` says what it takes)\n"
    )


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


def test_status_says_a_crash_looping_process_restarts_and_why(tmp_path):
    """A syncer that dies as it starts shows, within seconds, as crash-looping with its
    restarts and the last line of its traceback, not as a syncer still starting."""
    import json
    import time

    from tests.support.runs import TINY_RECIPE, deep_update, diloco, write_yaml

    (tmp_path / "broken_model.py").write_text(
        "def build(**kwargs):\n    raise RuntimeError('this model cannot be built on this machine')\n"
    )
    recipe = write_yaml(
        tmp_path / "recipe.yaml",
        deep_update(
            TINY_RECIPE, {"model": {"factory": "broken_model:build", "kwargs": {}}, "training": {"num_learners": 4}}
        ),
    )
    runs_dir = tmp_path / "runs"
    environment = {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    diloco("up", str(recipe), "--name", "loop", "--runs-dir", str(runs_dir), env=environment)
    deadline, problems = time.monotonic() + 60, []
    while not any(problem.startswith("syncer is crash-looping") for problem in problems):
        assert time.monotonic() < deadline, problems
        time.sleep(1)
        status = json.loads(diloco("status", "loop", "-o", "json", "--runs-dir", str(runs_dir)).stdout)
        problems = status["problems"]
    line = next(problem for problem in problems if problem.startswith("syncer is crash-looping"))
    assert "times in a row, each within a minute of its start" in line  # two crashes at least: one is a restart
    assert "last error: RuntimeError: this model cannot be built on this machine" in line
    assert "`diloco logs loop syncer`" in line
    shown = diloco("status", "loop", "--runs-dir", str(runs_dir)).stdout
    assert "! syncer is crash-looping" in shown
    diloco("down", "loop", "--runs-dir", str(runs_dir))
