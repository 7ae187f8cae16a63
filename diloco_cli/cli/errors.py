"""Turning user mistakes into one clear line and a non-zero exit, and a closed pipe into a
quiet success."""

from __future__ import annotations

import functools
import io
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from diloco_cli.cli.entry import EXIT_INTERRUPTED, STARTING

Function = TypeVar("Function", bound=Callable)
EXIT_USER_ERROR = 2


def silence_stdout() -> None:
    """Point standard output at /dev/null: the reader of a pipe went away (``diloco logs
    RUN | head``), and what is still buffered must not fail again when Python exits."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # not a real file (a test's runner)
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), descriptor)


def reported(function: Function) -> Function:
    """Print ConfigError, StorageError, PayloadError (an object refused as damaged or
    forged) and OSError (a file or host that is not there) as ``error: ...`` and exit
    with code 2: every mistake is one line, never a traceback.  A pipe closed by its
    reader ends the command with success."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except BrokenPipeError:
            silence_stdout()
            raise click.exceptions.Exit(0) from None
        except click.exceptions.Exit:  # an exit code decided
            raise
        except Exception as error:
            # imported here, not at start: `diloco --help` must not pay for them
            from diloco_cli.codec.errors import PayloadError
            from diloco_cli.config.errors import ConfigError, wraps_an_interrupt
            from diloco_cli.store.filesystem import StorageError

            if wraps_an_interrupt(error):  # a Ctrl-C inside pydantic's serializer is a Ctrl-C
                raise KeyboardInterrupt from None
            if not isinstance(error, ConfigError | StorageError | PayloadError | OSError):
                raise
            click.echo(f"error: {error}", err=True)
            raise click.exceptions.Exit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]


def usage_line(error: Exception) -> str:
    """A command-line mistake as one line: which command, what is wrong, where to look."""
    message = " ".join(error.format_message().split()).replace("Value error, ", "").rstrip(".")
    if isinstance(error, click.NoSuchOption):  # in the words the command line has always used
        message = message.replace(f"No such option {error.option_name!r}", f"No such option: {error.option_name}")
    context = getattr(error, "ctx", None)
    if context is None:
        return f"error: {message}"
    command = context.command_path
    return f"error: {command}: {message} (`{command} --help` says what it takes)"


class OneLineErrors(click.Group):
    """The ``diloco`` command group: a mistake on the command line (an unknown option, a
    value of the wrong kind or out of range, a missing argument) is one line on stderr
    and exit code 2, instead of click's usage block."""

    def main(
        self,
        args: Any = None,
        prog_name: Any = None,
        complete_var: Any = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as error:
            click.echo(usage_line(error), err=True)
            code = error.exit_code
        except click.Abort:  # end of input at a prompt
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        """Parse the command line; Ctrl-C while it parses is one line and exit code 130."""
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo(STARTING, err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None

    def invoke(self, context: Any) -> Any:
        """Run the command; Ctrl-C where the command does not handle it itself is one
        line and exit code 130 (click's own is "Aborted!")."""
        try:
            return super().invoke(context)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None

    def list_commands(self, context: Any) -> list[str]:
        """The commands in the order they were added (the order of ``--help``)."""
        return list(self.commands)
