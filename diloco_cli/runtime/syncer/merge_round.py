"""One merge round of one fragment: decode, anchor, weight, merge, outer step, publish.

The steps of the syncer's round (docs/algorithm.md, "The syncer, one round of fragment p",
steps 4-8), composed from the pure core and the codec.  Arrivals stream in one at a
time: each payload is loaded, verified and decoded directly on top of its base's drift
(``Delta_m = (Theta_now - Theta^b) + delta_m``) and folded into running sums, so the
round's memory does not depend on how many learners arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, decode_payload
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator, token_weight
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version


@dataclass(frozen=True)
class RoundInput:
    """One arrival to merge: who sent it, from which base, and how to fetch its bytes."""

    learner: LearnerId
    base_version: Version
    c_steps: int
    c_tokens: int
    load: Callable[[], bytes]


@dataclass
class RoundResult:
    """What a round produced: the published payload and the arrivals it used or refused."""

    payload: bytes
    merged: list[RoundInput] = field(default_factory=list)
    rejected: list[tuple[RoundInput, PayloadError]] = field(default_factory=list)


def merge_round(
    fragment: FragmentIndex,
    version: Version,
    arrivals: Sequence[RoundInput],
    parameters: Mapping[str, torch.Tensor],
    window: UpdateWindow,
    optimizer: NesterovOuterOptimizer,
    publisher: ExactPublisher,
    secret: RunSecret,
    mean_names: Collection[str] = (),
    meta: Mapping[str, object] | None = None,
) -> RoundResult:
    """Merge ``arrivals`` into fragment ``fragment`` and publish it as ``version``.

    ``parameters`` (fp32 CPU, the syncer's Theta for this fragment) are advanced in place
    by exactly the decoded update that the returned payload carries; ``window`` records
    the update.  Arrivals whose payloads fail verification are skipped and reported.
    """
    shapes = {name: tuple(tensor.shape) for name, tensor in parameters.items()}
    accumulator = MergeAccumulator(shapes, mean_names)
    scratch = {name: torch.empty(shape) for name, shape in shapes.items()}
    result = RoundResult(payload=b"")
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
    del scratch
    outer_gradient = accumulator.result()
    update = optimizer.step(fragment, parameters, outer_gradient)
    del outer_gradient
    for name, tensor in update.items():
        tensor.sub_(parameters[name])  # Theta_new - Theta, in place
    round_meta = {
        "fragment": fragment,
        "version": version,
        "merged": [a.learner for a in result.merged],
        **(meta or {}),
    }
    result.payload = publisher.encode_update(fragment, update, round_meta)
    del update
    apply_update(parameters, result.payload, secret)
    window.record(version, _decoder(result.payload, secret))
    return result


def _check_matches(meta: Mapping[str, object], arrival: RoundInput, fragment: FragmentIndex) -> None:
    expected = {"learner": arrival.learner, "fragment": fragment, "base_version": arrival.base_version}
    found = {key: meta.get(key) for key in expected}
    if found != expected:
        raise CorruptPayload(f"payload metadata {found} disagrees with its arrival record {expected}")


def _decoder(payload: bytes, secret: RunSecret) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: decode_payload(payload, secret).tensors
