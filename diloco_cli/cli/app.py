"""The ``diloco`` command: thin commands that parse, call one library function, render."""

from __future__ import annotations

import gc
import sys

import click

from diloco_cli import __version__
from diloco_cli.cli import (
    internal,
    live_commands,
    model_commands,
    plan_command,
    prepare_command,
    report_command,
    runs_commands,
    simulate_command,
)
from diloco_cli.cli.entry import EXIT_INTERRUPTED, STARTING
from diloco_cli.cli.errors import OneLineErrors, silence_stdout


def _print_version(context: click.Context, parameter: click.Parameter, value: bool) -> None:
    if value:
        click.echo(f"diloco {__version__}")
        context.exit()


@click.group(name="diloco", cls=OneLineErrors, invoke_without_command=True, subcommand_metavar="COMMAND [ARGS]...")
@click.option(
    "--version",
    is_flag=True,
    help="Print the version and exit.",
    callback=_print_version,
    is_eager=True,
    expose_value=False,
)
@click.pass_context
def app(context: click.Context) -> None:
    """Train one PyTorch model across regions and clouds joined only by object storage (Decoupled DiLoCo).

    M learners train on their own and never wait for one another; every H steps each writes a small, compressed,
    authenticated delta to its own region's bucket; a CPU syncer merges whatever K of the M have arrived and publishes
    new global weights back to every region.
    """
    if context.invoked_subcommand is None:  # bare `diloco`: what it can do, and success
        click.echo(context.get_help())
        context.exit(0)


runs_commands.register(app)
report_command.register(app)
model_commands.register(app)
plan_command.register(app)
prepare_command.register(app)
live_commands.register(app)
simulate_command.register(app)
internal.register(app)


def main() -> None:
    try:
        app(prog_name="diloco")
    except KeyboardInterrupt:  # while click parses, before any command began
        click.echo(STARTING, err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        try:  # what is still buffered, while a closed pipe can still be told from a failure
            sys.stdout.flush()
        except BrokenPipeError:  # `diloco runs | head -1`: the reader has all it wanted
            silence_stdout()
        if not _is_a_process_of_a_run(sys.argv[1:]):
            # The command is over: what the interpreter's last collection would walk is what
            # was imported (torch: 0.4 s of CPU for `diloco plan`, pydantic: 50 ms for
            # `status`). Nothing a command leaves behind waits on that collection: files are
            # closed where they are written, processes are detached; atexit handlers still run.
            gc.freeze()


def _is_a_process_of_a_run(arguments: list[str]) -> bool:
    """``diloco _learner`` and the other hidden commands the launchers start: a run's own
    processes (a learner may run the user's script), whose exit stays Python's own."""
    command = app.commands.get(arguments[0]) if arguments else None
    return command is not None and command.hidden
