"""Tokenizing a corpus into shard files in a local staging directory, resumably.

Documents are tokenized in order, each followed by the end-of-document token.  A
document is held out (:func:`is_heldout`) by its position alone, so the choice needs no
count of the documents ahead and is the same on every run; the others fill training
shards of ``shard_tokens`` tokens, in order (a document may continue in the next shard).

After each finished shard (written, synced, renamed into place) the progress record
(``progress.json``) lists it with its size and SHA-256 and the point in the corpus
where the next shard starts.  An interrupted run starts again from the end of the last
shard that is still whole: finished shards are checked against the record and kept,
never tokenized twice, and the held-out file is cut back to what that point had
written.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
from pydantic import BaseModel, Field

from diloco_cli.data.tokens.corpus import Corpus, CorpusFormat
from diloco_cli.data.tokens.index import FORMAT, FROZEN, DatasetError, Dtype, ShardEntry, parse_document
from diloco_cli.data.tokens.progress import Progress, counted
from diloco_cli.data.tokens.storage import file_sha256
from diloco_cli.data.tokens.tokenizer import DatasetTokenizer
from diloco_cli.store.filesystem import write_whole

PROGRESS_NAME = "progress.json"
HELDOUT_NAME = "heldout.bin"
PARTIAL_SUFFIX = ".partial"

ENCODE_BATCH_CHARACTERS = 1 << 20
"""Documents are encoded in batches of about this much text (tokenizers encodes a
batch on all cores)."""


def train_shard_name(number: int) -> str:
    return f"train-{number:05d}.bin"


def is_heldout(document: int, fraction: float) -> bool:
    """Whether document number ``document`` (from 0) is held out: those where
    ``ceil(n * fraction)`` steps up, so the first document always is and then about every
    ``1 / fraction``-th, a ``fraction`` of any prefix of the corpus."""
    return math.ceil((document + 1) * fraction) > math.ceil(document * fraction)


class TokenizeSettings(BaseModel):
    """What determines the shards: a resumed run must be given the same."""

    model_config = FROZEN

    corpus: str
    """The corpus's URL (or glob)."""
    corpus_format: CorpusFormat
    """How its files are read (see :class:`~diloco_cli.data.tokens.corpus.Corpus`)."""
    text_field: str
    """The key or column of the text (JSON lines, Parquet)."""
    separator: str
    """What separates documents (plain text)."""
    tokenizer_sha256: str
    """The tokenizer's ``tokenizer.json``, by hash."""
    eos_token_id: int
    """The token written after every document."""
    vocab_size: int
    """The tokenizer's vocabulary, special tokens included."""
    dtype: Dtype
    """The shards' token type."""
    shard_tokens: int = Field(ge=1)
    """Tokens per training shard (the last one fewer)."""
    heldout_fraction: float = Field(gt=0, lt=1)
    """The fraction of documents held out (see :func:`is_heldout`)."""


class ResumePoint(BaseModel):
    """Where in the corpus the token stream stands."""

    model_config = FROZEN

    document: int = Field(ge=0)
    """The next document to tokenize."""
    skip_tokens: int = Field(default=0, ge=0)
    """Its tokens (end-of-document token included) already in earlier shards."""
    heldout_tokens: int = Field(default=0, ge=0)
    """Held-out tokens written before this point."""
    shortest_document: int | None = Field(default=None, ge=0)
    """The fewest tokens of a document read so far (its end-of-document token left out)."""


class DocumentCounts(BaseModel):
    """What the corpus's documents came to, for ``prepare`` to say (a corpus cut into
    documents far shorter than a training sequence teaches a model to stop early)."""

    model_config = FROZEN

    documents: int = Field(ge=1)
    """Documents in the corpus, held out or not."""
    shortest: int = Field(ge=0)
    """Tokens of the shortest document, its end-of-document token left out."""


class FinishedShard(ShardEntry):
    """A training shard made durable, and where the next one starts."""

    end: ResumePoint


class ProgressRecord(BaseModel):
    """The staging directory's record of the shards made so far."""

    model_config = FROZEN

    format: Literal["diloco-tokens/1"] = FORMAT
    settings: TokenizeSettings
    train: tuple[FinishedShard, ...] = ()
    """Finished training shards, in order."""
    heldout: ShardEntry | None = None
    """The held-out shard, set once the whole corpus has been read."""
    documents: DocumentCounts | None = None
    """Set with ``heldout``, once the whole corpus has been read."""

    @property
    def start(self) -> ResumePoint:
        """Where tokenizing goes on from."""
        return self.train[-1].end if self.train else ResumePoint(document=0)


def read_progress(staging: Path) -> ProgressRecord | None:
    path = staging / PROGRESS_NAME
    if not path.exists():
        return None
    return parse_document(
        ProgressRecord, path.read_bytes(), str(path), "remove it (or give --overwrite) to start again"
    )


def save_progress(staging: Path, record: ProgressRecord) -> None:
    from fsspec.implementations.local import LocalFileSystem

    write_whole(LocalFileSystem(), str(staging / PROGRESS_NAME), (record.model_dump_json(indent=2) + "\n").encode())


def is_whole(staging: Path, shard: ShardEntry, item_bytes: int) -> bool:
    """Whether the staged file is the one the record describes (size, then SHA-256)."""
    path = staging / shard.name
    return path.is_file() and path.stat().st_size == shard.tokens * item_bytes and file_sha256(path) == shard.sha256


def verified(record: ProgressRecord, staging: Path) -> ProgressRecord:
    """The record cut back to its longest prefix of shards that are still whole."""
    item_bytes = np.dtype(record.settings.dtype).itemsize
    whole = 0
    while whole < len(record.train) and is_whole(staging, record.train[whole], item_bytes):
        whole += 1
    if whole == len(record.train) and record.heldout is not None and is_whole(staging, record.heldout, item_bytes):
        return record
    return record.model_copy(update={"train": record.train[:whole], "heldout": None})


class TrainShardWriter:
    """Cuts the training token stream into shards and records each one as it finishes.

    The held-out file in the making (``heldout``) is flushed to disk before each record:
    the record counts its tokens, and a run killed without a chance to flush (SIGKILL,
    SIGTERM's default) must find them there, or the rerun starts over."""

    def __init__(self, staging: Path, record: ProgressRecord, progress: Progress, heldout: BinaryIO) -> None:
        self.staging = staging
        self.heldout = heldout
        self.record = record
        self.progress = progress
        self.shard_tokens = record.settings.shard_tokens
        self.handle: BinaryIO | None = None
        self.digest = hashlib.sha256()
        self.written = 0
        self.end = record.start

    @property
    def name(self) -> str:
        return train_shard_name(len(self.record.train))

    def write(self, tokens: np.ndarray, document: int, skipped: int, heldout_tokens: int, shortest: int) -> None:
        """Append ``tokens`` (little-endian, of the record's dtype): document
        ``document``'s tokens from its ``skipped``-th on (``shortest``: the fewest tokens
        of a document so far, this one included)."""
        offset = 0
        while offset < len(tokens):
            if self.handle is None:
                self.handle = open(self.staging / (self.name + PARTIAL_SUFFIX), "wb")
            take = min(len(tokens) - offset, self.shard_tokens - self.written)
            data = tokens[offset : offset + take].tobytes()
            self.handle.write(data)
            self.digest.update(data)
            self.written += take
            offset += take
            if offset < len(tokens):
                self.end = ResumePoint(
                    document=document,
                    skip_tokens=skipped + offset,
                    heldout_tokens=heldout_tokens,
                    shortest_document=shortest,
                )
            else:
                self.end = ResumePoint(document=document + 1, heldout_tokens=heldout_tokens, shortest_document=shortest)
            if self.written == self.shard_tokens:
                self.finish()

    def finish(self) -> None:
        """Make the shard in the making durable and record it (nothing if it is empty)."""
        if self.handle is None:
            return
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        name = self.name
        os.replace(self.staging / (name + PARTIAL_SUFFIX), self.staging / name)
        self.heldout.flush()
        os.fsync(self.heldout.fileno())
        shard = FinishedShard(name=name, tokens=self.written, sha256=self.digest.hexdigest(), end=self.end)
        self.record = self.record.model_copy(update={"train": (*self.record.train, shard)})
        save_progress(self.staging, self.record)
        self.progress.done(name, reused=False)
        self.handle, self.digest, self.written = None, hashlib.sha256(), 0


@dataclass(frozen=True)
class Tokenized:
    """The staged shards and how many of them an earlier run had made."""

    record: ProgressRecord
    reused: int


def encoded_documents(
    corpus: Corpus, files: list[str], tokenizer: DatasetTokenizer, start: int, progress: Progress
) -> Iterator[tuple[int, list[int]]]:
    """``(number, token ids)`` of every document from number ``start`` on, in batches
    through the tokenizer; earlier documents are read (and reported) but not encoded."""
    batch: list[str] = []
    first = characters = 0
    for number, document in enumerate(counted(corpus.documents(files), progress)):
        if number < start:
            continue
        if not batch:
            first = number
        batch.append(document)
        characters += len(document)
        if characters >= ENCODE_BATCH_CHARACTERS:
            yield from enumerate(tokenizer.encode(batch), start=first)
            batch, characters = [], 0
    if batch:
        yield from enumerate(tokenizer.encode(batch), start=first)


def resumable(record: ProgressRecord, staging: Path) -> ProgressRecord:
    """The record with the held-out file in the making cut back to the record's start;
    from the corpus's start where that file lacks tokens the record counts."""
    partial, finished = staging / (HELDOUT_NAME + PARTIAL_SUFFIX), staging / HELDOUT_NAME
    if finished.exists():  # made, but not recorded before an interruption
        os.replace(finished, partial)
    item_bytes = np.dtype(record.settings.dtype).itemsize
    if not partial.exists() or partial.stat().st_size < record.start.heldout_tokens * item_bytes:
        record = record.model_copy(update={"train": ()})
    with open(partial, "ab") as heldout:
        heldout.truncate(record.start.heldout_tokens * item_bytes)
    return record


def tokenize_corpus(
    corpus: Corpus, tokenizer: DatasetTokenizer, settings: TokenizeSettings, staging: Path, progress: Progress
) -> Tokenized:
    """Tokenize ``corpus`` into ``staging`` (training shards, ``heldout.bin``), going on
    from the progress record there when it has the same settings."""
    staging.mkdir(parents=True, exist_ok=True)
    earlier = read_progress(staging)
    if earlier is not None and earlier.settings != settings:
        raise DatasetError(
            f"{staging} holds shards of another corpus or other settings; "
            "give the same options as before, or --overwrite to start again"
        )
    record = verified(earlier, staging) if earlier is not None else ProgressRecord(settings=settings)
    if record.heldout is None:
        record = resumable(record, staging)
    reused = len(record.train)
    for shard in record.train:
        progress.done(shard.name, reused=True)
    if record.heldout is not None:
        return Tokenized(record, reused)
    save_progress(staging, record)

    files = corpus.files()
    progress.begin(f"tokenizing {corpus.url}", corpus.total_bytes(files))
    start = record.start
    dtype = np.dtype(settings.dtype).newbyteorder("<")
    heldout_tokens = start.heldout_tokens
    read, shortest = start.document, start.shortest_document
    with open(staging / (HELDOUT_NAME + PARTIAL_SUFFIX), "ab") as heldout:
        writer = TrainShardWriter(staging, record, progress, heldout)
        for number, ids in encoded_documents(corpus, files, tokenizer, start.document, progress):
            skipped = start.skip_tokens if number == start.document else 0
            tokens = np.array([*ids, settings.eos_token_id], dtype=dtype)[skipped:]
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
            if is_heldout(number, settings.heldout_fraction):
                heldout.write(tokens.tobytes())
                heldout_tokens += len(tokens)
            else:
                writer.write(tokens, number, skipped, heldout_tokens, shortest)
            read = number + 1
        writer.finish()
    if read == 0:
        raise DatasetError(
            f"corpus {corpus.url} is empty: it holds no document (no text, no JSON line or row with text); "
            "give a corpus with text in it"
        )
    if not writer.record.train:
        raise DatasetError(
            f"corpus {corpus.url} leaves no training tokens: all of its documents are held out; "
            "give a larger corpus or a smaller --heldout-fraction"
        )
    os.replace(staging / (HELDOUT_NAME + PARTIAL_SUFFIX), staging / HELDOUT_NAME)
    heldout_shard = ShardEntry(name=HELDOUT_NAME, tokens=heldout_tokens, sha256=file_sha256(staging / HELDOUT_NAME))
    counts = DocumentCounts(documents=read, shortest=shortest or 0)
    record = writer.record.model_copy(update={"heldout": heldout_shard, "documents": counts})
    save_progress(staging, record)
    progress.done(HELDOUT_NAME, reused=False)
    return Tokenized(record, reused)
