"""The README is the front door: every command it shows runs, as written, in order.

The quick start's commands are taken from the README itself, so a command added there is
exercised here.  This runs the default job, untouched, to completion (several minutes).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.readme import code_blocks, diloco_commands
from tests.support.runs import interrupted_output, wait_processes_gone

pytestmark = pytest.mark.slow


def run(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    arguments = command.split()
    arguments = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', command)]
    return subprocess.run(
        [sys.executable, "-m", "diloco_cli", *arguments[1:]], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_every_readme_command_runs_as_written_on_the_default_job(tmp_path):
    commands = diloco_commands()
    started = run(commands[0], tmp_path, timeout=120)
    assert started.returncode == 0, started.stderr
    name = re.search(r"started run (\S+):", started.stdout).group(1)
    for command in commands[1:]:
        command = command.replace("RUN", name)
        if "--follow" in command:  # runs until Ctrl-C: give it a moment, then interrupt it
            arguments = [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', command)]
            output = interrupted_output(arguments[1:], tmp_path)
            assert "finished at step 300" in output, output[-2000:]
            continue
        result = run(command, tmp_path, timeout=1200)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if command.startswith("diloco status --watch"):
            assert f"run {name}  finished" in result.stdout, result.stdout[-3000:]
        if command.startswith("diloco sample"):
            assert result.stdout.startswith("ROMEO:")
        if command.startswith("diloco down"):
            wait_processes_gone(tmp_path / "runs", name)
    # the README's Python snippet loads the exported weights
    snippet = code_blocks("python")[0]
    loaded = subprocess.run(
        [sys.executable, "-c", snippet + "\nprint('loaded', sum(p.numel() for p in model.parameters()))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert loaded.returncode == 0, loaded.stderr
    assert "loaded 842496" in loaded.stdout
    status = run(f"diloco status {name} --output json", tmp_path, timeout=60)
    assert '"state": "finished"' in status.stdout
