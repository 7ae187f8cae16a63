"""Odd values (nan, inf, -1, 0, empty, huge) in every numeric option of every command:
each ends in success, or in one line on stderr and a non-zero exit; never a traceback."""

import click
import pytest
from click.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.cli.parameters import Real, Whole
from tests.support.runs_on_disk import published_run

ODD = ("nan", "inf", "-1", "0", "", "1e308", "1" + "0" * 30)

TEXT_NUMBERS = {
    ("plan", "--link-mbit"),
    ("plan", "--latency-ms"),
    ("simulate goodput", "--chips"),
    ("scale", "--learners"),
}
"""Options typed as text that hold numbers (a number per region, a count with k or M, a
signed count)."""


def commands(group: click.Group = app, path: str = ""):
    """(name, command) of every command a user can type, sub-commands too."""
    for name, command in group.commands.items():
        if command.hidden:
            continue
        if isinstance(command, click.Group):
            yield from commands(command, f"{path}{name} ")
        else:
            yield f"{path}{name}", command


def numeric_options() -> set[tuple[str, str]]:
    """(command, --option) of every option that takes a number."""
    found = set()
    for name, command in commands():
        for parameter in command.params:
            if not isinstance(parameter, click.Option) or parameter.is_flag:
                continue
            flag = next(d for d in parameter.opts if d.startswith("--"))
            if isinstance(parameter.type, Whole | Real) or (name, flag) in TEXT_NUMBERS:
                found.add((name, flag))
    return found


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("odd")
    runs_dir, _ = published_run(tmp_path, finished=True)  # nothing to scale: scale stops at its checks
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n\n" * 50)
    return tmp_path, runs_dir, corpus


def base_arguments(tmp_path, runs_dir, corpus) -> dict[str, list[str]]:
    """Per command, arguments with which it succeeds (quickly) on its own; but ``scale``,
    which would start learners: the run has finished, so it stops at its checks."""
    runs = ["--runs-dir", str(runs_dir)]
    tiny_simulation = ["--set", "horizon_days=0.02", "--set", "replicas=1"]
    return {
        "down": ["down", "made", *runs],
        "rm": ["rm", "--dry-run", "--older-than", "7", *runs],
        "sample": ["sample", "made", "-n", "2", *runs],
        "plan": ["plan", "--step-seconds", "0.5"],
        "prepare": ["prepare", str(corpus), "-o", str(tmp_path / "dataset"), "--vocab-size", "300", "--overwrite"],
        "simulate goodput": ["simulate", "goodput", "--chips", "150k", "--learners", "1", *tiny_simulation],
        "scale": ["scale", "made", "--region", "local-a", "--learners", "+1", *runs],
    }


def test_every_numeric_option_has_a_case_here(places):
    bases = base_arguments(*places)
    assert {command for command, _ in numeric_options()} == set(bases)
    for command, arguments in bases.items():
        result = CliRunner().invoke(app, arguments)
        assert (result.exit_code == 0) == (command != "scale"), (command, result.output)


@pytest.mark.parametrize("command, option", sorted(numeric_options()))
def test_odd_values_end_in_success_or_one_line(places, command, option):
    base = base_arguments(*places)[command]
    runner = CliRunner()
    for value in ODD:
        result = runner.invoke(app, [*base, option, value])
        shown = f"{command} {option} {value!r}: exit {result.exit_code}\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), shown + repr(result.exception)
        if result.exit_code != 0:
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, shown
