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
    """``--help``, ``status``, ``runs``, ``logs`` and ``down`` load without torch (a
    multi-second import), so they answer at once on any machine."""
    import subprocess
    import sys

    modules = ["diloco_cli.cli.app", "diloco_cli.views.status", "diloco_cli.launch.logs", "diloco_cli.views.runs", "diloco_cli.launch.operations"]
    probe = f"import sys; [__import__(m) for m in {modules!r}]; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
