"""Odd values (nan, inf, -1, 0, empty, huge) in every numeric option of every command:
each ends in success, or in one line on stderr and a non-zero exit; never a traceback."""

import inspect
import typing

import pytest
from typer.testing import CliRunner

from diloco_cli.cli.app import app
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


def commands():
    """(name, function) of every command a user can type, sub-commands too."""
    for info in app.registered_commands:
        if not info.hidden:
            yield info.name or info.callback.__name__, info.callback
    for group in app.registered_groups:
        for info in group.typer_instance.registered_commands:
            yield f"{group.typer_instance.info.name} {info.name or info.callback.__name__}", info.callback


def numeric_options() -> set[tuple[str, str]]:
    """(command, --option) of every option that takes a number."""
    found = set()
    for name, function in commands():
        function = inspect.unwrap(function)
        hints = typing.get_type_hints(function)
        for parameter in inspect.signature(function).parameters.values():
            option = parameter.default
            if type(option).__name__ != "OptionInfo":
                continue
            flag = next((d for d in option.param_decls if d.startswith("--")), "--" + parameter.name.replace("_", "-"))
            kinds = {hints[parameter.name], *typing.get_args(hints[parameter.name])}
            kinds |= {kind for outer in list(kinds) for kind in typing.get_args(outer)}
            if kinds & {int, float} or (name, flag) in TEXT_NUMBERS:
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
