"""Turning user mistakes into one clear message and a non-zero exit."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import typer

Function = TypeVar("Function", bound=Callable)
EXIT_USER_ERROR = 2


def reported(function: Function) -> Function:
    """Print ConfigError, StorageError, PayloadError (an object refused as damaged or
    forged) and OSError (a file or host that is not there) as ``error: ...`` and exit
    with code 2: every mistake is one line, never a traceback."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except BrokenPipeError:
            raise  # the reader went away: main() ends quietly
        except Exception as error:
            # imported here, not at start: `diloco --help` must not pay for them
            from diloco_cli.codec.errors import PayloadError
            from diloco_cli.config.errors import ConfigError
            from diloco_cli.store.filesystem import StorageError

            if not isinstance(error, ConfigError | StorageError | PayloadError | OSError):
                raise
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]
