"""The ledger of consumed payloads: each arrival merged at most once, in space that
does not grow with the number of versions.

A learner uploads its payloads strictly in the order it made them (one upload queue
that retries its head before anything newer), so for each learner and fragment the
sequence numbers reaching the syncer only grow, and so do those it merges.  The ledger
therefore keeps, per (learner, fragment), the largest sequence merged: every payload at
or below that mark is consumed.  Payloads consumed *without* a merge above the mark
(refused as damaged, or retired because their learner must resync) are kept by key until
a merge of the same learner and fragment passes them.  Its size is bounded by
learners x fragments plus the few such refusals, whatever the number of versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from diloco_cli.core.types import FragmentIndex, LearnerId

Slot = tuple[LearnerId, FragmentIndex]


@dataclass(frozen=True)
class PayloadId:
    """Where a payload is (opaque ``key``) and whose it is."""

    key: str
    learner: LearnerId
    fragment: FragmentIndex
    sequence: int

    @property
    def slot(self) -> Slot:
        return (self.learner, self.fragment)


@dataclass
class Ledger:
    merged: dict[Slot, int] = field(default_factory=dict)
    """The largest sequence merged per (learner, fragment)."""
    retired: dict[str, PayloadId] = field(default_factory=dict)
    """Payloads consumed unmerged above their slot's mark, by key."""

    def consumed(self, payload: PayloadId) -> bool:
        return payload.sequence <= self.merged.get(payload.slot, -1) or payload.key in self.retired

    def record(self, merged: Iterable[PayloadId], retired: Iterable[PayloadId]) -> None:
        """Consume ``merged`` and ``retired`` (the ledger entry of one commit)."""
        for payload in merged:
            self.merged[payload.slot] = max(self.merged.get(payload.slot, -1), payload.sequence)
        for payload in retired:
            self.retired[payload.key] = payload
        self.retired = {key: p for key, p in self.retired.items() if p.sequence > self.merged.get(p.slot, -1)}

    def to_json(self) -> dict:
        return {
            "merged": [[learner, fragment, sequence] for (learner, fragment), sequence in sorted(self.merged.items())],
            "retired": [[p.key, p.learner, p.fragment, p.sequence] for p in self.retired.values()],
        }

    @classmethod
    def from_json(cls, document: Mapping) -> Ledger:
        return cls(
            merged={
                (LearnerId(learner), FragmentIndex(int(fragment))): int(sequence)
                for learner, fragment, sequence in document["merged"]
            },
            retired={
                key: PayloadId(key, LearnerId(learner), FragmentIndex(int(fragment)), int(sequence))
                for key, learner, fragment, sequence in document["retired"]
            },
        )
