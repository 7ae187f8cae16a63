"""One merge round of one fragment: decode, anchor, weight, merge, outer step, publish.

The steps of the syncer's round (docs/algorithm.md, "The syncer, one round of fragment p",
steps 4-8), composed from the pure core and the codec.  Payloads the syncer reads itself
are anchored and accumulated by :func:`~diloco_cli.runtime.outer_gradients.accumulate_arrivals`;
aggregates from the regions' reducers, already anchored at the fragment's version, add
their partial sums (:meth:`~diloco_cli.core.merge.MergeAccumulator.add_partial`).  Then
the merged outer gradient takes the Nesterov outer step, and the update is published
exactly (every holder adds the same decoded bits).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, decode_payload
from diloco_cli.codec.aggregate import decode_aggregate
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.runtime.outer_gradients import RoundInput, accumulate_arrivals

__all__ = ["AggregateInput", "RoundInput", "RoundResult", "merge_round"]


@dataclass(frozen=True)
class AggregateInput:
    """A region's aggregate to merge: its key and how to fetch its bytes."""

    key: str
    load: Callable[[], bytes]


@dataclass
class RoundResult:
    """What a round produced: the published payload and the arrivals it used or refused."""

    payload: bytes
    merged: list[RoundInput] = field(default_factory=list)
    rejected: list[tuple[RoundInput, PayloadError]] = field(default_factory=list)
    merged_aggregates: list[AggregateInput] = field(default_factory=list)
    rejected_aggregates: list[tuple[AggregateInput, PayloadError]] = field(default_factory=list)


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
    aggregates: Sequence[AggregateInput] = (),
) -> RoundResult:
    """Merge ``arrivals`` and ``aggregates`` into fragment ``fragment`` and publish it as ``version``.

    ``parameters`` (fp32 CPU, the syncer's Theta for this fragment) are advanced in place
    by exactly the decoded update that the returned payload carries; ``window`` records
    the update.  Arrivals and aggregates that fail verification are skipped and reported.
    """
    shapes = {name: tuple(tensor.shape) for name, tensor in parameters.items()}
    accumulator = MergeAccumulator(shapes, mean_names)
    accumulated = accumulate_arrivals(fragment, arrivals, shapes, window, secret, accumulator)
    result = RoundResult(payload=b"", merged=accumulated.merged, rejected=accumulated.rejected)
    for aggregate in aggregates:
        try:
            part, aggregate_meta = decode_aggregate(aggregate.load(), secret)
            _check_aggregate(aggregate_meta, fragment, window.newest)
            accumulator.add_partial(part)
        except (PayloadError, ValueError) as error:
            result.rejected_aggregates.append((aggregate, _as_payload_error(error)))
            continue
        result.merged_aggregates.append(aggregate)
    outer_gradient = accumulator.result()
    update = optimizer.step(fragment, parameters, outer_gradient)
    del outer_gradient
    for name, tensor in update.items():
        tensor.sub_(parameters[name])  # Theta_new - Theta, in place
    merged_learners = [a.learner for a in result.merged]
    round_meta = {"fragment": fragment, "version": version, "merged": merged_learners, **(meta or {})}
    result.payload = publisher.encode_update(fragment, update, round_meta)
    del update
    apply_update(parameters, result.payload, secret)
    window.record(version, _decoder(result.payload, secret))
    return result


def _check_aggregate(meta: Mapping[str, object], fragment: FragmentIndex, version: Version) -> None:
    if meta.get("fragment") != fragment or meta.get("anchor") != version:
        found = (meta.get("fragment"), meta.get("anchor"))
        raise CorruptPayload(
            f"the aggregate is of fragment {found[0]} at version {found[1]}, not {fragment} at {version}"
        )


def _as_payload_error(error: Exception) -> PayloadError:
    return error if isinstance(error, PayloadError) else CorruptPayload(str(error))


def _decoder(payload: bytes, secret: RunSecret) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: decode_payload(payload, secret).tensors
