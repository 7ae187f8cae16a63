"""The traffic model of a Decoupled DiLoCo run, and synchronous data-parallel beside it.

Pure formulas over numbers: nothing here reads a file, builds a model or looks at a
clock.  :mod:`diloco_cli.bandwidth.traffic_plan` measures the inputs (an inner step, the real
size of every payload the codecs make, the training thread's time to encode and apply
them, with :mod:`diloco_cli.bandwidth.measure`) and calls :func:`predict` and
:func:`predict_data_parallel`.  The sizes of the JSON documents (head, heartbeats,
status) are in :mod:`diloco_cli.bandwidth.document_sizes`.

Notation: M learners, M_r of them in region r, K the quorum, P fragments, H inner
steps between two sends of a fragment, S ``snapshot_every``, t the compute time of one
inner step, o the training thread's overhead per step, T = t + o.

Every region r has one wide-area link, between its bucket and the syncer: none when
the syncer runs in that region (the default: the first region), whose link is local.  A
learner only talks to its own region's bucket (region-local, not WAN).  Directions are
seen from the syncer: *down* is what it reads from a bucket, *up* what it writes there.
Per second, on the link of region r (docs/bandwidth.md has the tables):

* down: what the region's reducer passes on (:mod:`diloco_cli.core.forwarding`).
  Under K = M its aggregates, about min(M_r P/(H T), merges) of them (one per fragment
  round), each the size of one learner payload of its fragment, and their markers (which
  list the sends they hold); under K < M every send as the learner made it (a relay: a
  payload and its marker, P every H steps per learner, deleted by the syncer once
  merged).  A listing of ``aggregates/`` and one of ``relays/`` per poll; the heartbeats
  (one per learner every ``status_seconds``, 2 s), and the reducer's status as often; a
  listing of the whole run now and then (leftovers).  The learners' payloads, the
  snapshots and the garbage collection stay in the region.
* up: per merge (K = M: P/(H T) merges per second; K < M: up to M/K times as many) the
  update and its marker, the head; the syncer's status every ``status_seconds`` (2 s).

The syncer decides on one thread but calls every region's bucket at once, each region's
calls in order; so besides each link's utilization (its busier direction over its
capacity) the model counts the syncer's *I/O time* per second on its slowest link:
bytes over rate plus a round trip (2 x one-way latency) per request.
"""

from __future__ import annotations

import math

from diloco_cli.bandwidth.document_sizes import (
    head_bytes,
    heartbeat_bytes,
    history_samples,
    status_bytes,
)
from diloco_cli.bandwidth.flows import link_traffic, per_round_and_clock_bytes
from diloco_cli.bandwidth.ring import data_parallel_bytes_per_step, ring_allreduce_seconds, ring_region_crossings
from diloco_cli.bandwidth.shapes import DataParallelPrediction, DiLoCoPrediction, Link, RunShape
from diloco_cli.core.fragments import sends_per_learner

# ------------------------------------------------------------------------ formulas


def overhead_seconds(shape: RunShape) -> float:
    """o, the training thread's time per inner step beside compute::

        (sum_p encode_p + (M/K) sum_p install_p) / H  +  checkpoint / checkpoint_every

    (every fragment is encoded once per H steps; every merged version of it, M/K per H
    steps, is added and checked)."""
    ratio = shape.num_learners / shape.quorum
    per_interval = sum(shape.uploads.seconds) + ratio * sum(shape.updates.seconds)
    return per_interval / shape.sync_interval + shape.checkpoint_seconds / shape.checkpoint_every_steps


def predict(shape: RunShape) -> DiLoCoPrediction:
    """Traffic per link, compute share and token rates of a Decoupled DiLoCo run.

    ``T = t + o``; per second M P/(H T) payloads are sent and (M/K) P/(H T) versions
    published (under K = M about min(M_r P/(H T), merges) aggregates cross from each
    region, under K < M its M_r P/(H T) relayed sends); each link carries the flows of
    :func:`link_flows`, a link local to the syncer no WAN bytes.  Learners never wait
    for the network (uploads run in the background and the outbox folds unsent payloads
    into newer ones), so the network shows as a factor on useful work::

        network_factor = min(1, capacity / required on every WAN link, 1 / syncer_busy)
        compute_share  = t / T x network_factor
    """
    s = shape
    M, K, P = s.num_learners, s.quorum, s.num_fragments
    if not 1 <= K <= M:
        raise ValueError(f"the quorum K must be between 1 and M={M}, got {K}")
    if len(s.uploads.bytes) != P or len(s.updates.bytes) != P:
        raise ValueError(f"codec costs must name {P} fragments")
    overhead = overhead_seconds(s)
    period = s.step_seconds + overhead
    merges = M / K * P / (s.sync_interval * period)
    samples = history_samples(s.inner_steps * period)
    versions = M / K * P * s.inner_steps / s.sync_interval
    head = head_bytes(P, 1.5 * s.snapshot_every)
    status = status_bytes(
        M, len(s.links), P, versions / s.evaluate_every / 2, samples, s.learner_id_bytes, s.region_name_bytes
    )
    beat = heartbeat_bytes(P, samples)
    links = tuple(link_traffic(s, link, period, head, status, beat, samples) for link in s.links)
    # the syncer calls every region at once (runtime.syncer.fanout): the slowest region sets its pace
    busy = max(link.syncer_seconds_per_second for link in links) + merges * max(link.poll_seconds for link in links)
    factor, bottleneck = 1.0, "none"
    for link in links:
        if link.utilization is not None and link.utilization > 1 and 1 / link.utilization < factor:
            direction = "up" if link.up_bytes_per_second >= link.down_bytes_per_second else "down"
            factor, bottleneck = 1 / link.utilization, f"link {link.region} ({direction})"
    if busy > 1 and 1 / busy < factor:
        factor, bottleneck = 1 / busy, "syncer I/O"
    cpu_share = s.step_seconds / period
    trained = M * s.tokens_per_step / period
    wan = sum(link.up_bytes_per_second + link.down_bytes_per_second for link in links if link.wan)
    rounds = sends_per_learner(s.inner_steps, s.sync_interval, P, s.sync_interval_schedule)
    loop_seconds = s.inner_steps * period
    run_seconds = s.startup_seconds + loop_seconds
    run_wan = 0.0
    for link in (link for link in links if link.wan):
        per_round, clock = per_round_and_clock_bytes(link)
        steady_rounds = P * s.inner_steps / s.sync_interval  # what the steady rates count
        run_wan += loop_seconds * per_round * factor * rounds / steady_rounds + run_seconds * clock
    return DiLoCoPrediction(
        num_learners=M,
        quorum=K,
        sync_interval=s.sync_interval,
        num_fragments=P,
        upload_codec=s.uploads.codec,
        update_codec=s.updates.codec,
        step_seconds=s.step_seconds,
        overhead_seconds=overhead,
        period_seconds=period,
        sends_per_second=M * P / (s.sync_interval * period),
        merges_per_second=merges,
        cpu_share=cpu_share,
        links=links,
        syncer_busy=busy,
        network_factor=factor,
        compute_share=cpu_share * factor,
        compute_share_with_startup=cpu_share * factor * loop_seconds / run_seconds,
        bottleneck=bottleneck,
        trained_tokens_per_second=trained,
        useful_tokens_per_second=trained * factor,
        wan_bytes_per_second=wan,
        wan_bytes_per_token=wan / trained,
        rounds_per_learner=rounds,
        rounds_crossing_per_learner=rounds * factor,
        run_wan_bytes=run_wan,
        head_bytes=head,
        status_bytes=status,
        heartbeat_bytes=beat,
    )


def smallest_sync_interval(shape: RunShape, target: float, largest: int) -> DiLoCoPrediction | None:
    """The prediction at the smallest H in ``1..largest`` whose compute share reaches
    ``target``, or None when even H = ``largest`` does not.  The share only grows with H
    (every term of o and of the traffic that depends on H falls as it grows), so a
    bisection finds it."""
    at = lambda interval: predict(shape.model_copy(update={"sync_interval": interval}))  # noqa: E731
    best = at(largest)
    if best.compute_share < target:
        return None
    low, high = 0, largest  # share(low) < target <= share(high)
    while high - low > 1:
        middle = (low + high) // 2
        prediction = at(middle)
        if prediction.compute_share >= target:
            high, best = middle, prediction
        else:
            low = middle
    return best


def predict_data_parallel(
    parameters: int, links: tuple[Link, ...], step_seconds: float, tokens_per_step: int, bytes_per_value: int = 2
) -> DataParallelPrediction:
    """Synchronous data-parallel training with one worker per learner on the same links::

        bytes_per_step = 2 (W-1)/W x bytes_per_value x N      (per worker, each way)
        allreduce      = bytes_per_step / slowest WAN rate + 2 (W-1) x largest latency
        step           = t + allreduce,   compute share = t / step
        WAN bytes      = R x bytes_per_step per step          (R hops between regions)

    A conservative ring for time: every hop is taken to cross the slowest WAN link.  For
    bytes, only the R hops between regions cross the WAN (the rest stay in a region)."""
    workers = sum(link.learners for link in links)
    wan = [link for link in links if link.wan]
    rate = min((link.bytes_per_second for link in wan), default=math.inf)
    latency = max((link.latency_ms for link in wan), default=0.0)
    per_step = data_parallel_bytes_per_step(parameters, workers, bytes_per_value)
    crossings = ring_region_crossings(link.learners for link in links)
    allreduce = ring_allreduce_seconds(per_step, workers, rate, latency / 1000)
    step = step_seconds + allreduce
    return DataParallelPrediction(
        workers=workers,
        parameters=parameters,
        bytes_per_value=bytes_per_value,
        formula=f"2(W-1)/W x {bytes_per_value} B x N = 2x{workers - 1}/{workers} x {bytes_per_value} x {parameters:,}",
        bytes_per_step=per_step,
        slowest_link_mbit=None if math.isinf(rate) else rate * 8 / 1e6,
        latency_ms=latency,
        allreduce_seconds=allreduce,
        step_seconds=step,
        compute_share=step_seconds / step,
        tokens_per_second=workers * tokens_per_step / step,
        region_crossings=crossings,
        wan_bytes_per_token=crossings * per_step / (workers * tokens_per_step),
    )
