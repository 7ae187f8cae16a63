"""Learners' payloads into a merge's running sums: decode, anchor, weight, accumulate.

The first half of a merge round (docs/algorithm.md, "The syncer, one round of fragment
p", steps 4-6), done by the syncer for payloads it reads itself and by a region's
reducer for its learners' payloads.  Arrivals stream in one at a time: each payload is
verified, decompressed, and folded into a
:class:`~diloco_cli.core.merge.MergeAccumulator` on top of its base's drift
(``Delta_m = (Theta_now - Theta^b) + delta_m``, the drift summed from the window of
published updates) by the codec's fused kernels
(:class:`~diloco_cli.codec.fold.AnchoredPayload`), so memory does not grow with the
number of arrivals.  With several threads the next payload is loaded, verified and
decompressed on a background thread while this one is folded in on the others.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, read_header
from diloco_cli.codec.fold import AnchoredPayload
from diloco_cli.codec.frame import PayloadBody, open_payload
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator, token_weight
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.workspace import MergeWorkspace
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
    workspace: MergeWorkspace | None = None,
) -> Accumulated:
    """Fold every arrival's anchored outer gradient into ``accumulator`` with its token
    weight; arrivals whose payloads fail verification are skipped and reported.  Every
    base must be anchorable by ``window`` (whose newest version is Theta_now).

    Arrivals from the newest version come first, then the others newest base first
    (each base's drift built on the one before).  ``workspace`` lends the drift, the
    bodies' buffers and the threads (none: new buffers, one thread).
    """
    workspace = workspace or MergeWorkspace()
    result = Accumulated()
    by_base: dict[Version, list[RoundInput]] = {}
    for arrival in arrivals:
        by_base.setdefault(arrival.base_version, []).append(arrival)
    window.check_anchorable(sorted(by_base, reverse=True))
    fresh = by_base.pop(window.newest, [])
    stale_bases = sorted(by_base, reverse=True)
    in_order = [*fresh, *(a for base in stale_bases for a in by_base[base])]
    opened = _Opener(in_order, secret, workspace, sum(math.prod(shape) for shape in shapes.values()))

    def fold(drift: Mapping | None) -> None:
        arrival, body = opened.next()
        try:
            if isinstance(body, PayloadError):
                raise body
            _check_matches(body.meta, arrival, fragment)
            _check_tensors(body, shapes)
        except PayloadError as error:
            result.rejected.append((arrival, error))
            return
        gradients = AnchoredPayload(body, drift, workspace.pool)
        accumulator.add(gradients, token_weight(arrival.c_tokens, arrival.c_steps))
        result.merged.append(arrival)

    drifts = iter(())
    try:
        if stale_bases:
            drifts = window.drifts(stale_bases, shapes, into=workspace.tensors("drift", shapes))
            # the newest stale base's drift is built now, while the first payload is opened
            drifts = itertools.chain([next(drifts)], drifts)
        for _ in fresh:
            fold(None)  # no drift: decoded straight into the sums
        for base, drift in drifts:
            for _ in by_base[base]:
                fold(drift)
    finally:
        opened.close()
    return result


PREFETCH_VALUES = 1 << 20
"""Payloads of fragments of fewer values are opened when they are reached: handing the
work to another thread would cost more than it overlaps."""


class _Opener:
    """Each arrival's verified body (or why it has none), in order.  With several
    threads the bodies are opened ahead on the background thread, from the moment this
    is made: the next while this one is folded in (two bodies in memory whatever the
    number of arrivals).  With one thread, or a small fragment, each is opened when it
    is reached."""

    def __init__(self, arrivals: list[RoundInput], secret: RunSecret, workspace: MergeWorkspace, values: int) -> None:
        self._arrivals, self._secret, self._workspace = arrivals, secret, workspace
        self._lookahead = 1 if workspace.threads > 1 and values >= PREFETCH_VALUES else 0
        self._pending: deque[Future[PayloadBody | PayloadError]] = deque()
        self._submitted = self._taken = 0
        if self._lookahead:
            self._submit_up_to(0)

    def next(self) -> tuple[RoundInput, PayloadBody | PayloadError]:
        index = self._taken
        self._taken += 1
        if not self._lookahead:
            return self._arrivals[index], self._open(index)
        self._submit_up_to(index)
        return self._arrivals[index], self._pending.popleft().result()

    def close(self) -> None:
        """Wait for what is being opened: a body must not be written into a buffer that
        the next round reuses."""
        for future in self._pending:
            future.exception()

    def _submit_up_to(self, index: int) -> None:
        # the buffer slot of the body opened next is that of the arrival folded before this one
        while self._submitted < len(self._arrivals) and self._submitted <= index + self._lookahead:
            self._pending.append(self._workspace.pool.background(lambda k=self._submitted: self._open(k)))
            self._submitted += 1

    def _open(self, index: int) -> PayloadBody | PayloadError:
        slot = f"body-{index % (self._lookahead + 1)}"
        try:
            return open_payload(
                self._arrivals[index].load(), self._secret, buffer=lambda size: self._workspace.buffer(slot, size)
            )
        except PayloadError as error:
            return error


def _check_matches(meta: Mapping[str, object], arrival: RoundInput, fragment: FragmentIndex) -> None:
    expected = {"learner": arrival.learner, "fragment": fragment, "base_version": arrival.base_version}
    found = {key: meta.get(key) for key in expected}
    if found != expected:
        raise CorruptPayload(f"payload metadata {found} disagrees with its arrival record {expected}")


def _check_tensors(body: PayloadBody, shapes: Mapping[str, tuple[int, ...]]) -> None:
    found = {entry.name: entry.shape for entry in body.header.tensors}
    if found != {name: tuple(shape) for name, shape in shapes.items()}:
        raise CorruptPayload(f"the payload holds tensors {found}, the fragment {dict(shapes)}")


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
