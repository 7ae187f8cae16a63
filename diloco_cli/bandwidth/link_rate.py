"""The link rate each method needs to keep its learners computing a share of wall time.

The paper's measure of bandwidth (Decoupled DiLoCo, arXiv 2604.21428: 198 Gbit/s for
data-parallel against 0.84 Gbit/s across datacentres): the slowest WAN link at which
training still computes ``target`` (90%) of wall time.  For synchronous data-parallel,
a step computes ``t`` then communicates, so the all-reduce may take at most
``t x (1/target - 1)`` (a ninth of compute at 90%)::

    flat ring       2 (W-1)/W x b x N / rate + 2 (W-1) x latency  <=  t (1/target - 1)
    hierarchical    2 (R-1)/R x b x N / rate + 2 (R-1) x latency  <=  t (1/target - 1)

(every hop over the slowest link; the hierarchical all-reduce crosses only in its ring of
R region leaders, the reduce and broadcast inside each region being fast).  For Decoupled
DiLoCo learners never wait for the network: the rate is the lowest at which the links and
the syncer carry every learner's sends to a merge on time, so that
:func:`~diloco_cli.bandwidth.model.predict`'s compute share (the training thread's share
times the network factor) reaches the target.  None: no rate reaches it (latency alone,
or the training thread's own overhead, costs more than the target allows).  It is never
below the rate at which the largest update crosses in one request within the storage
client's timeout (:data:`OBJECT_SECONDS`).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from diloco_cli.bandwidth.model import predict
from diloco_cli.bandwidth.ring import data_parallel_bytes_per_step
from diloco_cli.bandwidth.shapes import RunShape

OBJECT_SECONDS = 15.0
"""The longest one write across a link may take: s3fs's default read timeout.  A PUT whose
answer has not come this long after its body went out fails and starts again, so below
``largest update / OBJECT_SECONDS`` the syncer's updates to a remote region never arrive
however long the run waits (bench.wan at 0.049 Mbit/s: a 225 KB update failed every
try).  A region's ``storage_options: {config_kwargs: {read_timeout: S}}`` raises it."""

COMPUTE_TARGET = 0.9
"""The share of wall time the learners compute at the rates reported (the paper's 90%)."""
LOWEST_MBIT, HIGHEST_MBIT = 1e-6, 1e7
"""The range searched for Decoupled DiLoCo's rate, in Mbit/s."""


class LinkRates(BaseModel):
    """The WAN link rate (each direction, every WAN link alike) each method needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_compute_share: float
    """The share of wall time computing that the rates keep."""
    diloco_mbit: float | None
    """Decoupled DiLoCo's lowest rate (None: none reaches the target)."""
    flat_ring_mbit: float | None
    """Synchronous data-parallel with a flat ring all-reduce."""
    hierarchical_mbit: float | None
    """Synchronous data-parallel with a hierarchical all-reduce (a ring of region leaders)."""
    diloco_object_mbit: float = 0.0
    """The rate below which Decoupled DiLoCo's largest update cannot be written across a
    link in one request (:data:`OBJECT_SECONDS`): ``diloco_mbit`` is at least this."""

    def _over_diloco(self, rate: float | None) -> float | None:
        return rate / self.diloco_mbit if rate is not None and self.diloco_mbit else None

    @property
    def flat_ring_over_diloco(self) -> float | None:
        return self._over_diloco(self.flat_ring_mbit)

    @property
    def hierarchical_over_diloco(self) -> float | None:
        return self._over_diloco(self.hierarchical_mbit)


def allreduce_rate_mbit(
    bytes_per_step: float, hops: int, step_seconds: float, latency_seconds: float, target: float
) -> float | None:
    """The rate at which a ring all-reduce of ``bytes_per_step`` per member, ``hops`` =
    2 (members - 1) latencies, takes at most ``step_seconds x (1/target - 1)``."""
    budget = step_seconds * (1 / target - 1) - hops * latency_seconds
    if bytes_per_step <= 0:
        return 0.0
    if budget <= 0:
        return None
    return bytes_per_step / budget * 8 / 1e6


def object_rate_mbit(shape: RunShape) -> float:
    """The rate below which the largest update cannot be written across a link within
    :data:`OBJECT_SECONDS`."""
    return max(shape.updates.bytes, default=0) * 8 / OBJECT_SECONDS / 1e6


def diloco_rate_mbit(shape: RunShape, target: float = COMPUTE_TARGET) -> float | None:
    """The lowest rate of every WAN link at which ``predict`` computes ``target`` (the
    compute share only grows with the rate, so a bisection in log space finds it), and
    at which the largest update still crosses in one request (:func:`object_rate_mbit`)."""
    rate = _shared_rate_mbit(shape, target)
    if rate is None or not any(link.wan for link in shape.links):
        return rate
    return max(rate, object_rate_mbit(shape))


def _shared_rate_mbit(shape: RunShape, target: float) -> float | None:

    def share(rate: float) -> float:
        links = tuple(
            link if link.rate_mbit is None else link.model_copy(update={"rate_mbit": rate}) for link in shape.links
        )
        return predict(shape.model_copy(update={"links": links})).compute_share

    if not any(link.wan for link in shape.links):
        return 0.0 if share(HIGHEST_MBIT) >= target else None
    if share(HIGHEST_MBIT) < target:
        return None
    low, high = math.log(LOWEST_MBIT), math.log(HIGHEST_MBIT)
    if share(LOWEST_MBIT) >= target:
        return LOWEST_MBIT
    for _ in range(60):  # share(exp(low)) < target <= share(exp(high)); 60 halvings: far below a 0.1% step
        middle = (low + high) / 2
        if share(math.exp(middle)) >= target:
            high = middle
        else:
            low = middle
    return math.exp(high)


def link_rates(shape: RunShape, parameters: int, bytes_per_value: int = 2, target: float = COMPUTE_TARGET) -> LinkRates:
    """Each method's rate for the same model, learners, step time and latencies."""
    workers = shape.num_learners
    regions = sum(1 for link in shape.links if link.learners > 0)
    latency = max((link.latency_ms for link in shape.links if link.wan), default=0.0) / 1000
    t = shape.step_seconds
    flat = allreduce_rate_mbit(
        data_parallel_bytes_per_step(parameters, workers, bytes_per_value), 2 * (workers - 1), t, latency, target
    )
    hierarchical = allreduce_rate_mbit(
        data_parallel_bytes_per_step(parameters, regions, bytes_per_value), 2 * (regions - 1), t, latency, target
    )
    return LinkRates(
        target_compute_share=target,
        diloco_mbit=diloco_rate_mbit(shape, target),
        diloco_object_mbit=object_rate_mbit(shape),
        flat_ring_mbit=flat,
        hierarchical_mbit=hierarchical,
    )
