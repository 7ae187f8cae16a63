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
