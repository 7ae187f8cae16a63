"""What ``diloco prepare`` shows: its progress on stderr (bars on a terminal, lines
elsewhere) and, on stdout, what was made, kept and skipped, and where the index is."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a view renders what the data package made; it calls nothing there
    from diloco_cli.data.tokens.index import DatasetIndex
    from diloco_cli.data.tokens.prepare import Prepared
    from diloco_cli.data.tokens.storage import Location


class Bars:
    """Progress as rich bars on stderr (a terminal)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        self.bars = Progress(*columns, console=Console(stderr=True))
        self.task = None

    def begin(self, description: str, total: int | None) -> None:
        self._end_task()
        self.task = self.bars.add_task(description, total=total)

    def advance(self, amount: int) -> None:
        self.bars.advance(self.task, amount)

    def done(self, item: str, reused: bool) -> None:
        pass

    def _end_task(self) -> None:
        """Show the stage that ends as full (a stage's total may be an estimate, or none)."""
        if self.task is not None:
            task = self.bars.tasks[-1]
            finished = task.total if task.total is not None else task.completed
            self.bars.update(self.task, total=finished, completed=finished)

    def __enter__(self) -> Bars:
        self.bars.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._end_task()
        self.bars.stop()


class Lines:
    """Progress as plain lines on stderr (not a terminal: logs, pipes)."""

    def begin(self, description: str, total: int | None) -> None:
        print(f"{description} ...", file=sys.stderr, flush=True)

    def advance(self, amount: int) -> None:
        pass

    def done(self, item: str, reused: bool) -> None:
        print(f"  {item}{' (kept from an earlier run)' if reused else ''}", file=sys.stderr, flush=True)

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *_: object) -> None:
        pass


def progress_display() -> Bars | Lines:
    """Bars when stderr is a terminal, else plain lines (logs, pipes)."""
    return Bars() if sys.stderr.isatty() else Lines()


SHORT_DOCUMENT_TOKENS = 128
"""Documents shorter than this on average are far shorter than a training sequence (128
tokens in the default recipe, 1024 in recipes/llama-small.yaml): a model trained on them
learns to end its text after about as many tokens."""


def render_prepared(prepared: Prepared) -> str:
    """What was made (documents, tokens, shards), kept and skipped, every location's
    index, and where its URL goes."""
    if prepared.index is None:
        lines = [f"already complete, nothing to do (--overwrite makes it again): {url}" for url in prepared.index_urls]
        return "\n".join([*lines, where_it_goes(prepared.index_urls)])
    index = prepared.index
    lines = [] if prepared.vocab_size_asked is None else [vocabulary_note(prepared.vocab_size_asked, index.vocab_size)]
    if prepared.documents is not None:
        lines.append(documents_line(prepared.documents.documents, prepared.documents.shortest, index))
    lines += [
        f"{index.train_tokens:,} training tokens in {len(index.train)} shards and "
        f"{index.heldout.tokens:,} held-out tokens "
        f"({index.dtype}, vocab {index.vocab_size:,}, tokenizer sha256 {index.tokenizer_sha256[:12]})",
        f"shards: {prepared.shards_made} made, {prepared.shards_reused} kept from an earlier run; "
        f"uploads: {prepared.uploads_skipped} files already in place",
    ]
    lines += [
        f"index: {url}{' (already complete)' if url in prepared.complete_before else ''}" for url in prepared.index_urls
    ]
    return "\n".join([*lines, where_it_goes(prepared.index_urls)])


def mean_document_tokens(documents: int, index: DatasetIndex) -> float:
    """Tokens per document on average, each one's end-of-document token left out."""
    return (index.train_tokens + index.heldout.tokens - documents) / documents


def documents_line(documents: int, shortest: int, index: DatasetIndex) -> str:
    tokens = index.train_tokens + index.heldout.tokens
    return (
        f"{documents:,} documents, {tokens:,} tokens: {mean_document_tokens(documents, index):,.0f} tokens "
        f"a document on average, the shortest {shortest:,}"
    )


def short_documents_warning(prepared: Prepared) -> str | None:
    """A warning when the corpus's documents are far shorter than a training sequence,
    pointing at ``--separator`` when it is what cut them; else None."""
    if prepared.index is None or prepared.documents is None:
        return None
    mean = mean_document_tokens(prepared.documents.documents, prepared.index)
    if mean >= SHORT_DOCUMENT_TOKENS:
        return None
    warning = (
        f"warning: the documents average {mean:,.0f} tokens, far shorter than a training sequence "
        f"({SHORT_DOCUMENT_TOKENS} tokens in the default recipe, 1024 in recipes/llama-small.yaml); "
        "every document ends with the end-of-document token, so a model trained on them learns to end its text "
        "after about as many tokens"
    )
    if prepared.separator is None:
        return warning
    return (
        f"{warning}. The separator {prepared.separator!r} cut the text into them: if a document of yours is longer "
        "(a source file, an article), give --separator what only comes between two documents, or put one document "
        "per line in JSON lines (diloco prepare --help; docs/data.md, 'Plain text and --separator'), then run "
        "prepare again with --overwrite"
    )


def where_it_goes(index_urls: tuple[str, ...]) -> str:
    """Where a printed index URL goes: the recipe's ``data.source``."""
    first = index_urls[0]
    line = f"train on it: diloco up RECIPE --set data.source={first}  (or data.source in the recipe)"
    if len(index_urls) > 1:
        line += "\n  (each region's data_source in the region file may name the region's own copy)"
    return line


def vocabulary_note(asked: int, made: int) -> str:
    return (
        f"vocabulary: {made:,} tokens made, {asked:,} asked: the corpus has no more pairs to merge; "
        f"the model's vocab_size must be at least {made:,} (more is harmless)"
    )


def render_indexed(index: DatasetIndex, location: Location) -> str:
    """What ``diloco prepare --existing`` indexed, and where the index is."""
    return (
        f"indexed {index.train_tokens:,} training tokens in {len(index.train)} shards and "
        f"{index.heldout.tokens:,} held-out tokens ({index.dtype}, vocab {index.vocab_size:,})\n"
        f"index: {location.index_url}\n{where_it_goes((location.index_url,))}"
    )
