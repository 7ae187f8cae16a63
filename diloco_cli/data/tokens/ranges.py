"""Which training tokens a process reads, and which of them each step trains on.

Pure arithmetic, no I/O.  The training token stream is the concatenation of the
training shards, ``T`` tokens.  Learner ``shard`` of ``num_shards`` owns the contiguous
range ``[shard * T // num_shards, (shard + 1) * T // num_shards)`` and, when it runs as
several processes, process ``rank`` of ``world_size`` the same split of that range:
the ranges of all processes are disjoint and cover every training token, and a range
may span shard files.

A process trains on its range as consecutive windows of ``sequence_length + 1`` tokens
(inputs and next-token targets); window ``w`` starts at token ``w * sequence_length``
of the range, so consecutive windows share one token, the last target of one being the
first input of the next.  Step ``s`` takes windows ``s * batch_size`` onwards, modulo
the windows that fit in the range (an epoch), so a step's data is a function of the step
alone: resuming at step ``s`` reads exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from diloco_cli.data.tokens.index import DatasetError


@dataclass(frozen=True)
class TokenRange:
    """Tokens ``[start, end)`` of the training stream."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def split(total: int, part: int, parts: int) -> TokenRange:
    """Part ``part`` of ``parts`` near-equal contiguous parts of ``[0, total)``."""
    if not 0 <= part < parts:
        raise ValueError(f"part {part} of {parts} does not exist")
    return TokenRange(part * total // parts, (part + 1) * total // parts)


def process_range(total: int, shard: int, num_shards: int, rank: int, world_size: int) -> TokenRange:
    """The training tokens of process ``rank`` of ``world_size`` of learner ``shard`` of ``num_shards``."""
    learner = split(total, shard, num_shards)
    within = split(len(learner), rank, world_size)
    return TokenRange(learner.start + within.start, learner.start + within.end)


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


def windows_per_epoch(range_tokens: int, sequence_length: int) -> int:
    """How many windows of ``sequence_length + 1`` tokens, ``sequence_length`` apart, fit."""
    windows = (range_tokens - 1) // sequence_length
    if windows < 1:
        raise DatasetError(
            f"this process's range of {range_tokens} training tokens is shorter than one sequence of "
            f"{sequence_length + 1}; "
            "train with fewer learners or processes, a shorter data.sequence_length, or more data"
        )
    return windows


def window_runs(step: int, batch_size: int, windows: int) -> list[tuple[int, int]]:
    """The windows of step ``step`` as runs of consecutive windows ``(first, count)``:
    one run, or more where the batch wraps around the end of the range."""
    runs = []
    first, remaining = step * batch_size % windows, batch_size
    while remaining:
        count = min(remaining, windows - first)
        runs.append((first, count))
        first, remaining = 0, remaining - count
    return runs
