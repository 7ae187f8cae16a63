"""What the run asks of a learner, and how its storage rank tells every process of it.

The syncer speaks to a learner through its control note (drain, H under dynamic local
updates, a new slice of the data, resync); ``diloco down`` through a signal.  Both reach
the storage rank alone, which folds them into :class:`Instructions`.  Under ``torchrun``
every process must then act alike at the same point, so after each step the storage rank
broadcasts a :class:`StepControl` (its instructions and what each fragment installs);
at the start a :class:`StartPoint`, at the end the :class:`FinalSends`.  Each record
travels as one int64 tensor (:func:`share`); its fields keep their names on both sides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Protocol, TypeVar

import torch

from diloco_cli.runtime.distributed import ProcessGroup, broadcast_ints
from diloco_cli.store.documents import ControlNote

log = logging.getLogger("diloco.learner")


class Install(IntEnum):
    """How a fragment is installed into the parameters after a step."""

    NONE = 0
    OVERWRITE = 1
    """The new global version replaces the fragment."""
    KEEP_UNSENT = 2
    """The new global version plus the work not sent yet (``sync.install: keep-unsent``)."""


@dataclass(frozen=True)
class Instructions:
    """What the run asks of this learner now."""

    sync_interval: int
    """H for this learner: the recipe's, or the syncer's H_m under dynamic local updates."""
    stop: bool = False
    """Stop now (``diloco down``, SIGTERM): finish the step, checkpoint where it stands,
    deliver the uploads in flight."""
    drain: bool = False
    """Leave the run (``diloco scale --learners -N``): send what was trained, then stop."""
    data_partition: tuple[int, int] | None = None
    """(slice, number of slices) assigned since the run was scaled; None: as at start."""

    @property
    def leaving(self) -> bool:
        return self.stop or self.drain

    def following(self, note: ControlNote, recipe_sync_interval: int) -> Instructions:
        """These instructions with the syncer's note taken in (drain, H, data slice)."""
        drain = self.drain or note.drain
        if drain and not self.drain:
            log.info("the run drains this learner: sending what it trained, then stopping")
        interval = note.sync_interval or recipe_sync_interval
        if interval != self.sync_interval:
            log.info(
                "sending every %d steps now (dynamic local updates; the recipe's H is %d)",
                interval,
                recipe_sync_interval,
            )
        partition = self.data_partition
        if note.data_slices and note.data_slice is not None and (note.data_slice, note.data_slices) != partition:
            partition = (note.data_slice, note.data_slices)
            log.info("the run was scaled: training on slice %d of %d of the data now", *partition)
        return replace(self, drain=drain, sync_interval=interval, data_partition=partition)


class _Record(Protocol):
    def to_ints(self) -> list[int]: ...


Record = TypeVar("Record", bound=_Record)


def share(group: ProcessGroup, record: Record, device: torch.device) -> Record:
    """The storage rank's ``record`` on every process of the learner (a collective; each
    rank passes a record of the same shape, the others' values are replaced)."""
    return type(record).from_ints(broadcast_ints(group, record.to_ints(), device))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StepControl:
    """After a step: the instructions, and how each fragment installs (by index)."""

    instructions: Instructions
    installs: tuple[Install, ...]

    def to_ints(self) -> list[int]:
        i = self.instructions
        slice_, slices = i.data_partition or (-1, 0)
        return [int(i.stop), int(i.drain), i.sync_interval, slice_, slices, *map(int, self.installs)]

    @classmethod
    def from_ints(cls, values: list[int]) -> StepControl:
        stop, drain, interval, slice_, slices, *installs = values
        partition = (slice_, slices) if slices else None
        instructions = Instructions(interval, bool(stop), bool(drain), partition)
        return cls(instructions, tuple(Install(how) for how in installs))


@dataclass(frozen=True)
class StartPoint:
    """Where every process starts: the step, whether from a checkpoint, whether a stop
    (``diloco down``) came while the learner was starting, and whether the run was over
    before it started (it then leaves at once, as a drained learner does)."""

    step: int
    from_checkpoint: bool
    stop: bool = False
    run_over: bool = False

    def to_ints(self) -> list[int]:
        return [self.step, int(self.from_checkpoint), int(self.stop), int(self.run_over)]

    @classmethod
    def from_ints(cls, values: list[int]) -> StartPoint:
        return cls(values[0], bool(values[1]), bool(values[2]), bool(values[3]))


@dataclass(frozen=True)
class FinalSends:
    """At the end: which fragments still hold work not sent (by index)."""

    due: tuple[bool, ...]

    def to_ints(self) -> list[int]:
        return [int(due) for due in self.due]

    @classmethod
    def from_ints(cls, values: list[int]) -> FinalSends:
        return cls(tuple(bool(value) for value in values))
