"""Ctrl-C during ``diloco up``, at several moments: before any process starts nothing is
left; once they start, the start is finished and the run's name printed with the command
that stops it. Never a process that nobody was told about."""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_cli.launch.local import stop_local
from diloco_cli.launch.runs import list_runs
from tests.support.runs import TINY_RECIPE, deep_update, write_yaml

pytestmark = pytest.mark.slow

MOMENTS = [  # (before about 0.1 s Python itself is starting, and dies of any SIGINT)
    ("seconds", 0.3),  # loading the command
    ("seconds", 0.6),
    ("seconds", 0.9),
    ("seconds", 1.5),
    ("seconds", 2.5),
    ("seconds", 4.0),
    ("the run's folder appears", "*"),
    ("a supervisor writes its state", "*/processes/*.json"),
    ("a learner writes its log", "*/logs/local-a-0.log"),
]


PYTHON_M = (sys.executable, "-m", "diloco_cli")


def console_script(folder: Path) -> tuple[str, ...]:
    """The ``diloco`` executable that pip writes for pyproject.toml's entry point (its
    template, as a user's install has it), in ``folder``."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    module, function = pyproject["project"]["scripts"]["diloco"].split(":")
    script = folder / "diloco"
    script.write_text(
        f"#!{sys.executable}\nimport re\nimport sys\nfrom {module} import {function}\n"
        "if __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        f"    sys.exit({function}())\n"
    )
    script.chmod(0o755)
    return (str(script),)


def python_start_seconds() -> float:
    """How long Python itself takes to start here now (``python -c pass``, the median of 3):
    a SIGINT before its ``site`` is imported ends it with Python's own traceback."""
    times = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.monotonic() - started)
    return sorted(times)[1]


def supervisors_under(folder: Path) -> list[int]:
    """Live supervisors of runs under ``folder`` (by their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        if b"diloco_cli.launch.supervisor" in arguments and any(str(folder).encode() in a for a in arguments):
            found.append(int(entry.name))
    return found


def interrupt_up(
    files: list[str], runs_dir: Path, moment: tuple[str, object], command: tuple[str, ...] = PYTHON_M
) -> subprocess.CompletedProcess:
    """``diloco up``, and SIGINT (Ctrl-C) at ``moment``: after some seconds, or as soon as
    a path matching a pattern appears under ``runs_dir``."""
    process = subprocess.Popen(
        [*command, "up", *files, "--runs-dir", str(runs_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    kind, value = moment
    deadline = time.monotonic() + (value if kind == "seconds" else 60)
    while time.monotonic() < deadline and process.poll() is None:
        if kind != "seconds" and any(runs_dir.glob(str(value))):
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize("moment", MOMENTS, ids=[f"{kind} {value}" for kind, value in MOMENTS])
def test_ctrl_c_during_up_leaves_nothing_unnamed(tmp_path, moment):
    recipe = write_yaml(tmp_path / "recipe.yaml", deep_update(TINY_RECIPE, {"training": {"inner_steps": 2000}}))
    regions = [
        {"name": name, "bucket": f"file://{tmp_path}/buckets/{name}", "hosts": [{"name": "local", "learners": 1}]}
        for name in ("east", "west")
    ]
    runs_dir = tmp_path / "runs"
    files = [str(recipe), "--regions", str(write_yaml(tmp_path / "regions.yaml", {"regions": regions}))]
    try:
        result = interrupt_up(files, runs_dir, moment)
        said = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        assert "Traceback" not in result.stderr, said
        # 0: up was done before the signal; -2: the signal came while Python itself was starting or
        # ending (it handles none then), before up began or after it was done
        assert result.returncode in (130, 0, -2), said
        named = re.findall(r"started run (\S+):", result.stdout)
        if moment[0] == "a supervisor writes its state":  # mid-start: it finishes starting and says so
            assert named and result.returncode == 130, said
        runs = sorted(path.name for path in runs_dir.iterdir()) if runs_dir.exists() else []
        if named:  # it had started: finished starting, said so, and goes on
            assert runs == named and f"stop it:    diloco down {named[0]}" in result.stdout, said
            if result.returncode == 130:
                assert f"interrupted: run {named[0]}" in result.stderr, said
            recorded = sorted(process["pid"] for process in list_runs(runs_dir)[0].processes)
            # the syncer, a reducer per region and 2 learners
            assert len(recorded) == 5 and sorted(supervisors_under(runs_dir)) == recorded, said
        else:  # nothing had started: nothing is left
            assert runs == [] and supervisors_under(runs_dir) == [], said
            assert not any((tmp_path / "buckets").rglob("*.json")), said  # no manifest either
            assert (result.returncode, result.stderr) == (-2, "") or result.stderr.startswith("interrupted"), said
    finally:
        for record in list_runs(runs_dir) if runs_dir.exists() else []:
            stop_local(record, timeout=10)
        assert supervisors_under(runs_dir) == []


def test_ctrl_c_in_the_first_seconds_of_the_diloco_executable_is_one_line_and_exit_130(tmp_path):
    """The ``diloco`` a user's shell runs, interrupted while it loads click and the commands
    (0.1 s, or twice Python's own start on a busy machine), while ``up`` parses and checks
    (0.5 s), and while it prepares the run (1.8 s): one line on stderr, exit code 130,
    never a traceback, nothing left."""
    recipe = write_yaml(tmp_path / "recipe.yaml", deep_update(TINY_RECIPE, {"training": {"inner_steps": 2000}}))
    regions = [
        {"name": name, "bucket": f"file://{tmp_path}/buckets/{name}", "hosts": [{"name": "local", "learners": 1}]}
        for name in ("east", "west")
    ]
    files = [str(recipe), "--regions", str(write_yaml(tmp_path / "regions.yaml", {"regions": regions}))]
    command = console_script(tmp_path)
    for seconds in (max(0.1, 2 * python_start_seconds()), 0.5, 1.8):
        runs_dir = tmp_path / f"runs-{seconds}"
        try:
            result = interrupt_up(files, runs_dir, ("seconds", seconds), command)
            said = f"at {seconds} s: exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            assert "Traceback" not in result.stderr and result.returncode == 130, said
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("interrupted"), said
            if "started run" not in result.stdout:  # (on a fast machine, 1.8 s may be after the start)
                assert not runs_dir.exists() or not any(runs_dir.iterdir()), said
        finally:
            for record in list_runs(runs_dir) if runs_dir.exists() else []:
                stop_local(record, timeout=10)
