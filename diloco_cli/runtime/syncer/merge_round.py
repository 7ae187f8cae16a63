"""One merge round of one fragment: decode, anchor, weight, merge, outer step, publish.

The steps of the syncer's round (docs/algorithm.md, "The syncer, one round of fragment p",
steps 4-8), composed from the pure core and the codec.  Payloads the syncer reads itself
are anchored and accumulated by :func:`~diloco_cli.runtime.outer_gradients.accumulate_arrivals`;
aggregates from the regions' reducers, already anchored at the fragment's version, add
their partial sums (:meth:`~diloco_cli.core.merge.MergeAccumulator.add_partial`).  Then
the merged outer gradient takes the Nesterov outer step, and the update is published
exactly (every holder adds the same decoded bits).

Steps 7-8 run chunk by chunk, each chunk on one of the workspace's threads while it is in
cache: the merged outer gradient (RDA's scale), the Nesterov step, ``U = Theta_new -
Theta``, its carry and quantization, and ``Theta += decode(U)`` (the arithmetic of
:func:`~diloco_cli.codec.exact.apply_update`, from the quantized body rather than from
the payload, which is then compressed and tagged).  The window keeps that body, so that
anchoring on this version later decodes it without verifying and decompressing it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret
from diloco_cli.codec.aggregate import decode_aggregate
from diloco_cli.codec.exact import ExactPublisher
from diloco_cli.codec.frame import PayloadBody
from diloco_cli.codec.parallel import KernelPool, torch_on_one_thread
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.runtime.outer_gradients import RoundInput, accumulate_arrivals
from diloco_cli.runtime.workspace import MergeWorkspace

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
    workspace: MergeWorkspace | None = None,
) -> RoundResult:
    """Merge ``arrivals`` and ``aggregates`` into fragment ``fragment`` and publish it as ``version``.

    ``parameters`` (fp32 CPU, the syncer's Theta for this fragment) are advanced in place
    by exactly the decoded update that the returned payload carries; ``window`` records
    the update.  Arrivals and aggregates that fail verification are skipped and reported.
    ``workspace`` lends buffers and threads (none: new buffers, one thread); the result
    is the same for any number of threads.
    """
    workspace = workspace or MergeWorkspace()
    shapes = {name: tuple(tensor.shape) for name, tensor in parameters.items()}
    accumulator = MergeAccumulator(shapes, mean_names, workspace)
    accumulated = accumulate_arrivals(fragment, arrivals, shapes, window, secret, accumulator, workspace)
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
    finishing = accumulator.finishing()
    merged_learners = [a.learner for a in result.merged]
    round_meta = {"fragment": fragment, "version": version, "merged": merged_learners, **(meta or {})}
    buffers, first_steps = optimizer.momentum_buffers(fragment, shapes)
    encoder = publisher.update_encoder(fragment, shapes)

    def finish(name: str, start: int, length: int) -> None:
        """Steps 7-8 on one chunk while it is in cache: the merged outer gradient, the
        outer step, ``U = Theta_new - Theta``, its carry and quantization, and
        ``Theta += decode(U)`` (apply_update's arithmetic).  Every step is elementwise
        (or blockwise, and chunks are whole blocks): the bits of whole-tensor steps.
        A non-finite update raises NonFiniteValues with some chunks applied, as it left
        the momentum and the carry half-stepped before: the syncer stops, and restarts
        from its home store."""
        total, merge = finishing[name]
        theta = parameters[name].view(-1)[start : start + length]
        gradient = merge(total.view(-1)[start : start + length])
        new_theta = optimizer.step_slice(
            gradient, buffers[name].view(-1)[start : start + length], theta, first=name in first_steps
        )
        encoder.encode(name, start, new_theta.sub_(theta))
        encoder.add_decoded(name, start, theta)

    pool = workspace.pool
    with torch_on_one_thread():
        for name, tensor in parameters.items():
            pool.map_chunks(
                lambda start, length, name=name: finish(name, start, length), tensor.numel(), encoder.block_size
            )
    body = encoder.body(round_meta)
    window.record(version, _adder(body, pool))
    # zstandard's workers, as many as the round's threads: the same bytes for any number
    result.payload = publisher.seal(body, compression_workers=pool.threads)
    return result


def _check_aggregate(meta: Mapping[str, object], fragment: FragmentIndex, version: Version) -> None:
    if meta.get("fragment") != fragment or meta.get("anchor") != version:
        found = (meta.get("fragment"), meta.get("anchor"))
        raise CorruptPayload(
            f"the aggregate is of fragment {found[0]} at version {found[1]}, not {fragment} at {version}"
        )


def _as_payload_error(error: Exception) -> PayloadError:
    return error if isinstance(error, PayloadError) else CorruptPayload(str(error))


def _adder(body: PayloadBody, pool: KernelPool) -> Callable[[Mapping[str, torch.Tensor]], None]:
    return lambda drift: body.decode_into(drift, accumulate=True, pool=pool)
