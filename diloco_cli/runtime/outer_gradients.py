"""Learners' payloads into a merge's running sums: decode, anchor, weight, accumulate.

The first half of a merge round (docs/algorithm.md, "The syncer, one round of fragment
p", steps 4-6), done by the syncer for payloads it reads itself and by a region's
reducer for its learners' payloads.  Arrivals stream in one at a time: each payload is
verified and decoded directly on top of its base's drift (``Delta_m = (Theta_now -
Theta^b) + delta_m``, the drift summed from the window of published updates) and folded
into a :class:`~diloco_cli.core.merge.MergeAccumulator`, so memory does not grow with the
number of arrivals.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, decode_payload, read_header
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator, token_weight
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.region import PayloadRecord

SAME_SEND = ("learner", "fragment", "base_version", "c_steps", "c_tokens", "step", "sent_at")
"""What a learner writes both into a payload's authenticated header and into its marker."""


@dataclass(frozen=True)
class RoundInput:
    """One arrival to merge: who sent it, from which base, and how to fetch its bytes."""

    learner: LearnerId
    base_version: Version
    c_steps: int
    c_tokens: int
    load: Callable[[], bytes]


@dataclass
class Accumulated:
    """Which arrivals went into the sums, and which were refused (with why)."""

    merged: list[RoundInput] = field(default_factory=list)
    rejected: list[tuple[RoundInput, PayloadError]] = field(default_factory=list)


def accumulate_arrivals(
    fragment: FragmentIndex,
    arrivals: Sequence[RoundInput],
    shapes: Mapping[str, tuple[int, ...]],
    window: UpdateWindow,
    secret: RunSecret,
    accumulator: MergeAccumulator,
) -> Accumulated:
    """Fold every arrival's anchored outer gradient into ``accumulator`` with its token
    weight; arrivals whose payloads fail verification are skipped and reported.  Every
    base must be anchorable by ``window`` (whose newest version is Theta_now)."""
    result = Accumulated()
    scratch = {name: torch.empty(shape) for name, shape in shapes.items()}
    by_base: dict[Version, list[RoundInput]] = {}
    for arrival in arrivals:
        by_base.setdefault(arrival.base_version, []).append(arrival)
    for base, drift in window.drifts(by_base, shapes):
        fresh = base == window.newest  # no drift: decode straight into the scratch
        for arrival in by_base[base]:
            if not fresh:
                for name, tensor in scratch.items():
                    tensor.copy_(drift[name])
            try:
                decoded = decode_payload(arrival.load(), secret, into=scratch, accumulate=not fresh)
                _check_matches(decoded.meta, arrival, fragment)
            except PayloadError as error:
                result.rejected.append((arrival, error))
                continue
            accumulator.add(scratch, token_weight(arrival.c_tokens, arrival.c_steps))
            result.merged.append(arrival)
    return result


def _check_matches(meta: Mapping[str, object], arrival: RoundInput, fragment: FragmentIndex) -> None:
    expected = {"learner": arrival.learner, "fragment": fragment, "base_version": arrival.base_version}
    found = {key: meta.get(key) for key in expected}
    if found != expected:
        raise CorruptPayload(f"payload metadata {found} disagrees with its arrival record {expected}")


def check_announced(record: PayloadRecord, blob: bytes | None, secret: RunSecret) -> None:
    """Raise PayloadError unless ``blob`` is authentic and is the very send its marker
    describes: an authentic older body of the same learner (a replay) differs in its
    step and counters, another run's in its tag."""
    if blob is None:
        raise CorruptPayload(f"{record.key} vanished before it could be merged")
    meta = read_header(blob, secret).meta
    differing = [field for field in SAME_SEND if meta.get(field) != record.meta.get(field)]
    if differing:
        raise CorruptPayload(
            f"{record.key} holds another send than its marker announced ({', '.join(differing)} differ): "
            "replayed or moved"
        )
