"""What ``diloco prepare`` reports as it goes; :mod:`diloco_cli.views.prepare` draws it (bars or lines)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol


class Progress(Protocol):
    """Stages of work measured in bytes, and each piece of work as it is made durable."""

    def begin(self, description: str, total: int | None) -> None:
        """A stage of ``total`` bytes (None: not known ahead) starts; the one before ends."""

    def advance(self, amount: int) -> None:
        """``amount`` more bytes of the current stage are done."""

    def done(self, item: str, reused: bool) -> None:
        """``item`` (a shard written, a file uploaded) is complete and recorded: an
        interruption from here on keeps it.  ``reused``: an earlier run had made it."""


class Silent:
    """Reports nothing."""

    def begin(self, description: str, total: int | None) -> None:
        pass

    def advance(self, amount: int) -> None:
        pass

    def done(self, item: str, reused: bool) -> None:
        pass


def counted(documents: Iterable[str], progress: Progress) -> Iterator[str]:
    """The documents, each reported done (its UTF-8 bytes) as it is taken."""
    for document in documents:
        progress.advance(len(document.encode()))
        yield document
