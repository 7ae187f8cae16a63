"""The ``diloco`` executable's first lines: a Ctrl-C while the command loads (click, the
commands, what they import) is one line and exit code 130, never a traceback."""

import sys

STARTING = "interrupted while diloco was starting; nothing was done"
EXIT_INTERRUPTED = 130


def main() -> None:
    """Load the command line, then run it; imports nothing but this module before."""
    try:
        from diloco_cli.cli.app import main as run
    except KeyboardInterrupt:
        print(STARTING, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    run()
