"""Ctrl-C held back while a run's processes are being started.

Processes start in sessions of their own, so a Ctrl-C reaches only ``diloco up``; cut
off half-way it would leave processes running that nobody was told about.  Inside
:func:`held_back` a Ctrl-C is noted (and said at once) instead, and the start goes on to
its end: the run's record written, its name and the command that stops it printed.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

NOTHING_STARTED = "interrupted before any process of the run started; nothing of it is left"


class Interrupted(Exception):
    """Ctrl-C during ``up``: before any process started (what was made is removed), or
    right after the start was said; the message says which."""


@dataclass
class Interruption:
    happened: bool = False
    """A Ctrl-C (SIGINT) arrived while it was held back."""


@contextmanager
def held_back(note: str) -> Iterator[Interruption]:
    """Hold SIGINT back for the block; the first one writes ``note`` (if any) to stderr at once.
    Where SIGINT is ignored (a shell's background job) or this is not the main thread,
    nothing changes."""
    interruption = Interruption()
    if threading.current_thread() is not threading.main_thread():
        yield interruption
        return

    def hold(signum, frame) -> None:
        if not interruption.happened and note:
            os.write(2, note.encode())  # not print(): a signal handler may interrupt a write of print's
        interruption.happened = True

    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield interruption
        return
    signal.signal(signal.SIGINT, hold)
    try:
        yield interruption
    finally:
        signal.signal(signal.SIGINT, previous)
