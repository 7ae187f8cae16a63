"""Which training tokens a process reads, and which of them each step trains on.

Pure arithmetic, no I/O.  The training token stream is the concatenation of the
training shards, ``T`` tokens.  It is cut into blocks of equal size (at most a chunk,
the unit of a ranged read), and the blocks are dealt out like cards: with ``parts =
num_shards * world_size`` processes in all, process ``rank`` of learner ``shard`` (part
``shard + num_shards * rank``) takes every ``parts``-th block from its part on.  Every
process gets the same number of blocks, no block goes to two processes, and all blocks
together cover the stream but its last few tokens (fewer than the number of blocks).
Every process reads its blocks in the same order, drawn from the run's seed: at any
step, the learners read neighbouring blocks of the stream.

Why deal blocks rather than give each learner a contiguous range: a corpus is often
sorted (by file name, source, date), and a contiguous quarter of it is a different kind
of text from the next quarter; learners reading different kinds of text diverge (one
learner's loss 6.06 against another's 3.01 at the same step on a name-sorted corpus).
Dealt blocks give every learner an even share of every part of the corpus, read at the
same time by all, and the seeded order spreads each kind of text over the whole run.

A process trains on its blocks read one after the other (its *tokens*) as consecutive
windows of ``sequence_length + 1`` tokens (inputs and next-token targets); window ``w``
starts at token ``w * sequence_length`` of them, so consecutive windows share one token,
the last target of one being the first input of the next (a window may join the end of
one block and the start of the next).  Step ``s`` takes windows ``s * batch_size``
onwards, modulo the windows that fit (an epoch), so a step's data is a function of the
step alone: resuming at step ``s`` reads exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from diloco_cli.data.tokens.index import DatasetError

MIN_BLOCKS_PER_PROCESS = 64
"""A process gets at least this many blocks, where the blocks can stay
:data:`MIN_BLOCK_TOKENS` long: so that even a small dataset is mixed."""

MIN_BLOCK_TOKENS = 4096
"""Blocks are no shorter than this, where the dataset allows (a few sequences each)."""


@dataclass(frozen=True)
class ProcessBlocks:
    """The blocks of the training stream one process reads, in reading order."""

    block_tokens: int
    blocks: tuple[int, ...]
    """Block ``b`` is stream tokens ``[b * block_tokens, (b + 1) * block_tokens)``."""

    @property
    def tokens(self) -> int:
        """How many tokens the process reads in an epoch."""
        return self.block_tokens * len(self.blocks)

    def start_of(self, block: int) -> int:
        """The stream position of the process's block number ``block`` (from 0)."""
        return self.blocks[block] * self.block_tokens


def block_order(count: int, seed: int) -> list[int]:
    """``0 .. count - 1`` in an order drawn from ``seed``: by a keyed hash of each
    number, so that every process on any platform and any version of numpy or torch
    draws the same order."""
    key = seed.to_bytes(8, "little", signed=True)

    def rank(block: int) -> bytes:
        return hashlib.blake2b(block.to_bytes(8, "little"), digest_size=8, key=key).digest()

    return sorted(range(count), key=rank)


def process_blocks(
    total: int, shard: int, num_shards: int, rank: int, world_size: int, chunk_tokens: int, seed: int
) -> ProcessBlocks:
    """The blocks of process ``rank`` of ``world_size`` of learner ``shard`` of
    ``num_shards``, for a stream of ``total`` tokens read in chunks of ``chunk_tokens``.

    Blocks are as long as a chunk when the stream is long enough for every process to get
    :data:`MIN_BLOCKS_PER_PROCESS` of them, else shorter (down to :data:`MIN_BLOCK_TOKENS`)
    so that each process still gets that many; a tiny stream gives fewer, longer ones."""
    if not (0 <= shard < num_shards and 0 <= rank < world_size):
        raise ValueError(f"process {rank} of {world_size} of learner {shard} of {num_shards} does not exist")
    parts = num_shards * world_size
    if total < parts:
        raise DatasetError(
            f"the dataset's {total} training tokens cannot be shared among {parts} processes; "
            "train with fewer learners or processes, or on more data"
        )
    per_process = max(
        math.ceil(total / (parts * chunk_tokens)), min(MIN_BLOCKS_PER_PROCESS, total // (parts * MIN_BLOCK_TOKENS)), 1
    )
    part = shard + num_shards * rank
    order = block_order(per_process, seed)
    return ProcessBlocks(total // (parts * per_process), tuple(turn * parts + part for turn in order))


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of file number ``file``."""

    file: int
    start: int
    end: int


class FileLayout:
    """Where each token of the concatenated stream lies: which file, at which offset."""

    def __init__(self, file_tokens: Sequence[int]) -> None:
        self.starts = [0, *accumulate(file_tokens)]

    @property
    def total(self) -> int:
        return self.starts[-1]

    def segments(self, start: int, end: int) -> list[Segment]:
        """The pieces of files that hold stream tokens ``[start, end)``, in order."""
        pieces = []
        file = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            stop = min(end, self.starts[file + 1])
            pieces.append(Segment(file, start - self.starts[file], stop - self.starts[file]))
            start, file = stop, file + 1
        return pieces


def windows_per_epoch(process_tokens: int, sequence_length: int) -> int:
    """How many windows of ``sequence_length + 1`` tokens, ``sequence_length`` apart, fit."""
    windows = (process_tokens - 1) // sequence_length
    if windows < 1:
        raise DatasetError(
            f"this process's {process_tokens} training tokens are fewer than one sequence of "
            f"{sequence_length + 1}; "
            "train with fewer learners or processes, a shorter data.sequence_length, or more data"
        )
    return windows


def window_runs(step: int, batch_size: int, windows: int) -> list[tuple[int, int]]:
    """The windows of step ``step`` as runs of consecutive windows ``(first, count)``:
    one run, or more where the batch wraps around the end of the process's tokens."""
    runs = []
    first, remaining = step * batch_size % windows, batch_size
    while remaining:
        count = min(remaining, windows - first)
        runs.append((first, count))
        first, remaining = 0, remaining - count
    return runs
