"""The command line's parameters on click: options and arguments that show their kind as
``<str>``, ``<path>``, ``<int range>``, ``<text|json>``, arguments listed under their own
heading with their help, and whole numbers refused in words people read.

click alone, so that a command starts in a few tens of milliseconds: typer converted every
parameter through a pydantic adapter, several times a bare interpreter's start before any
command ran (issue 32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click


class Whole(click.IntRange):
    """A whole number, optionally bounded; a mistake is said as ``Input should be greater
    than or equal to 1`` (the words the command line has always used)."""

    name = "integer"

    def __init__(self, minimum: int | None = None, maximum: int | None = None) -> None:
        super().__init__(minimum, maximum)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip())
            except ValueError:
                self.fail("Input should be a valid integer, unable to parse string as an integer", param, ctx)
        if self.min is not None and number < self.min:
            self.fail(f"Input should be greater than or equal to {self.min}", param, ctx)
        if self.max is not None and number > self.max:
            self.fail(f"Input should be less than or equal to {self.max}", param, ctx)
        return number

    def label(self) -> str:
        return "int range" if self.min is not None or self.max is not None else "int"

    def _describe_range(self) -> str:
        return super()._describe_range() if self.min is not None or self.max is not None else ""


class Real(click.ParamType):
    """A real number read by one of :mod:`diloco_cli.cli.numbers`' parsers, whose
    ``ValueError`` is the message."""

    name = "float"

    def __init__(self, parse: Callable[[Any], float]) -> None:
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            return self.parse(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


def any_number(value: Any) -> float:
    """A real number, ``nan`` and ``inf`` too (an option that bounds its value checks it)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError("Input should be a valid number, unable to parse string as a number") from None


PATH = click.Path(path_type=Path)
OUTPUT = click.Choice(["text", "json"])
"""``--output``: plain text, or JSON."""


def label(kind: click.ParamType) -> str:
    """``<str>``, ``<path>``, ``<text|json>``: what a parameter takes, for help."""
    if isinstance(kind, click.Choice):
        text = "|".join(str(choice) for choice in kind.choices)
    elif isinstance(kind, Whole):
        text = kind.label()
    elif isinstance(kind, click.Path):
        text = "path"
    elif isinstance(kind, Real):
        text = "float"
    else:
        text = "str"
    return f"<{text}>"


class Option(click.Option):
    """An option whose help shows its default and environment variable, and whose
    repeated values come as a list."""

    def __init__(self, param_decls: Sequence[str], **attrs: Any) -> None:
        attrs.setdefault("show_default", True)
        attrs.setdefault("show_envvar", True)
        super().__init__(param_decls, **attrs)

    def make_metavar(self, ctx: click.Context) -> str:
        return self.metavar if self.metavar is not None else label(self.type)

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        value = super().process_value(ctx, value)
        return list(value) if self.multiple and value is not None else value


class Argument(click.Argument):
    """An argument with a help text of its own, named in lower case as the function's
    parameter is (or by its metavar): ``{run}`` when required, ``[run]`` when not."""

    def __init__(self, param_decls: Sequence[str], help: str | None = None, **attrs: Any) -> None:
        super().__init__(param_decls, **attrs)
        self.help = help

    def shown_name(self) -> str:
        return self.metavar or self.name

    def display_name(self) -> str:
        return self.shown_name() + ("..." if self.nargs != 1 else "")

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        shown = f"{{{self.shown_name()}}}" if self.required else f"[{self.shown_name()}]"
        return [shown + ("..." if self.nargs != 1 else "")]

    def get_error_hint(self, ctx: click.Context | None = None) -> str:
        return f"'{self.shown_name()}'"

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        value = super().process_value(ctx, value)
        return list(value) if self.nargs != 1 and value is not None else value

    def get_help_record(self, ctx: click.Context) -> tuple[str, str]:
        kind = "<list[str]>" if self.nargs != 1 else label(self.type)
        extra = ["required"] if self.required else []
        help = self.help or ""
        if extra:
            help = f"{help}  [{'; '.join(extra)}]" if help else f"[{'; '.join(extra)}]"
        return f"{self.display_name()} {kind}", help


class Command(click.Command):
    """A command whose help lists its arguments under their own heading, then its options."""

    def format_arguments(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Nothing: :meth:`format_options` writes both (clicks before 8.5 have no such step)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        arguments, options = [], []
        for parameter in self.get_params(ctx):
            record = parameter.get_help_record(ctx)
            if record is not None:
                (arguments if isinstance(parameter, click.Argument) else options).append(record)
        for heading, records in (("Arguments", arguments), ("Options", options)):
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)


def command(**attrs: Any) -> Callable[[Callable], Command]:
    """``@command()``: a :class:`Command` named after its function (``_`` as ``-``)."""
    return click.command(cls=Command, **attrs)


def option(*param_decls: str, **attrs: Any) -> Callable:
    """``@option("--name", ...)``: an :class:`Option`."""
    return click.option(*param_decls, cls=Option, **attrs)


def argument(name: str, **attrs: Any) -> Callable:
    """``@argument("run", help=...)``: an :class:`Argument`."""
    return click.argument(name, cls=Argument, **attrs)


def runs_dir_option() -> Callable:
    """``--runs-dir``, of every command that reads a run's record here."""
    return option(
        "--runs-dir",
        type=PATH,
        default=Path("runs"),
        help="Where local run records live.",
        envvar="DILOCO_RUNS_DIR",
    )
