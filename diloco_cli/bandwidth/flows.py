"""The flows on each link of a Decoupled DiLoCo run: what the syncer, the reducers and
the learners read and write per second on every region's link (the notation and the
list of flows are in :mod:`diloco_cli.bandwidth.model`), each request's HTTP heads, and
the syncer's I/O time on the link.  Pure formulas over a :class:`RunShape`."""

from __future__ import annotations

import math
from typing import Literal

from diloco_cli.bandwidth.document_sizes import reducer_status_bytes
from diloco_cli.bandwidth.shapes import Flow, Link, LinkTraffic, RunShape
from diloco_cli.store.metering import LIST_PAGE_KEYS, LISTING_BYTES_PER_KEY, LISTING_BYTES_PER_REQUEST
from diloco_cli.store.wire import wire_model

# ------------------------------------------------------------------ listing estimate
# (the metering's own estimate, :mod:`diloco_cli.store.metering`, so that predictions and
# measurements count listings alike)


def listing_bytes(keys: float, key_bytes: float) -> float:
    """Estimated bytes of listing ``keys`` keys of ``key_bytes`` each:
    ``pages x LISTING_BYTES_PER_REQUEST + keys x (LISTING_BYTES_PER_KEY + key_bytes)``."""
    return listing_requests(keys) * LISTING_BYTES_PER_REQUEST + keys * (LISTING_BYTES_PER_KEY + key_bytes)


def listing_requests(keys: float) -> int:
    """Requests to list ``keys`` keys: one per page of :data:`LIST_PAGE_KEYS` (at least one)."""
    return max(1, math.ceil(keys / LIST_PAGE_KEYS))


# ------------------------------------------------------- what the syncer does and when

SWEEP_FRACTION = 4
"""The syncer lists each whole bucket for leftovers every ``leftover_seconds / 4``
(at least every second)."""

PAYLOADS_WAITING_PER_LEARNER = 1.0
"""Payloads of one learner that sit in its bucket, on average, when the syncer lists it:
each waits from its upload until its round merges (about one send interval H/P), so
about one per learner is there at any time.  Each is listed with its marker."""

CHECKPOINTS_KEPT = 2
"""A learner keeps its newest two checkpoints (each with a marker) in its bucket."""

SNAPSHOTS_KEPT = 2
"""Snapshots a bucket holds (the head's and the previous one)."""

AGGREGATES_WAITING_PER_FRAGMENT = 1.0
"""Aggregates of one fragment that sit in a region's bucket, on average, when the syncer
lists its ``aggregates/``: each waits from its forwarding until its round merges and the
reducer clears it.  Each is listed with its marker."""

RESIDUALS_KEPT_PER_FRAGMENT = 2
"""A reducer keeps, per fragment, its error feedback after the newest merged aggregate
and after the one in flight (each with a marker)."""


def _turn_interval(seconds: float, poll_seconds: float) -> float:
    """The syncer checks periodic work once per turn (every poll): ``ceil(s / poll) x poll``."""
    return max(1, math.ceil(seconds / poll_seconds - 1e-9)) * poll_seconds


def _flow(
    kind: str,
    direction: Literal["up", "down"],
    bytes_per_second: float,
    put: float = 0.0,
    get: float = 0.0,
    delete: float = 0.0,
    polling: bool = False,
) -> Flow:
    return Flow(
        kind=kind,
        direction=direction,
        bytes_per_second=bytes_per_second,
        put_per_second=put,
        get_per_second=get,
        delete_per_second=delete,
        polling=polling,
    )


Flows = tuple[tuple[Flow, ...], tuple[Flow, ...]]
"""What arrives on a link, and the listings that find it and the rest."""


def link_flows(
    shape: RunShape, link: Link, period: float, head: float, status: float, beat: float, samples: float
) -> tuple[Flow, ...]:
    """Every kind of object crossing ``link``, per second (see the module docstring):
    what arrives and its listings (:func:`_payload_flows`, or :func:`_aggregate_flows`
    with reducers), the heartbeats, then what the syncer publishes."""
    s = shape
    P, learners = s.num_fragments, link.learners
    sends = learners * P / (s.sync_interval * period)
    merges = s.num_learners / s.quorum * P / (s.sync_interval * period)
    update = sum(s.updates.bytes) / P
    beat_every = _turn_interval(min(s.status_seconds, s.heartbeat_seconds), s.poll_seconds)
    status_every = _turn_interval(s.status_seconds, s.poll_seconds)
    beats = learners / beat_every
    if s.reducers:
        arrivals, listings = _aggregate_flows(s, link, sends, merges, beat_every, samples)
        snapshots = 0.0  # each region's reducer writes its own
    else:
        arrivals, listings = _payload_flows(s, link, sends, merges)
        snapshots = merges / s.snapshot_every
    snapshot = (
        () if s.reducers else (_flow("snapshot", "up", snapshots * s.snapshot_bytes, put=snapshots, get=snapshots),)
    )
    return (
        *arrivals,
        _flow("heartbeat", "down", beats * beat, get=beats),
        *listings,
        # publish_update and write_snapshot first check that the marker is not there (a HEAD)
        _flow("update", "up", merges * update, put=merges, get=merges),
        _flow(
            "marker", "up", merges * s.update_marker_bytes + snapshots * s.snapshot_marker_bytes, put=merges + snapshots
        ),
        *snapshot,
        _flow("head", "up", merges * head, put=merges),
        _flow("status", "up", status / status_every, put=1 / status_every),
    )


def _sweep(shape: RunShape, learners: int) -> tuple[float, float]:
    """Bytes and LIST requests per second of listing one region's whole run for
    leftovers, every ``leftover_seconds / 4``.  Its keys: manifest, head, status, per
    learner its heartbeat, epoch, checkpoints and waiting payloads, the updates (1.5 S
    on average) and snapshots; with reducers also the aggregates waiting, the reducer's
    error feedback, its status and its epoch."""
    keys = (
        3
        + learners * (2 + 2 * CHECKPOINTS_KEPT + 2 * PAYLOADS_WAITING_PER_LEARNER)
        + 2 * 1.5 * shape.snapshot_every
        + 2 * SNAPSHOTS_KEPT
    )
    if shape.reducers:
        keys += 2 * shape.num_fragments * (AGGREGATES_WAITING_PER_FRAGMENT + RESIDUALS_KEPT_PER_FRAGMENT) + 2
    every = max(1.0, shape.leftover_seconds / SWEEP_FRACTION)
    return listing_bytes(keys, shape.key_prefix_bytes + 40) / every, listing_requests(keys) / every


def _payload_flows(shape: RunShape, link: Link, sends: float, merges: float) -> Flows:
    """Without reducers: the learners' payloads and markers (deleted once merged); the
    listing of ``payloads/`` per poll, the listing for leftovers and the garbage
    collection's after each snapshot."""
    s = shape
    P, S, learners = s.num_fragments, s.snapshot_every, link.learners
    payload = sum(s.uploads.bytes) / P
    deletes = 2 * sends if s.delete_consumed_payloads else 0.0
    prefix = s.key_prefix_bytes
    payload_key = prefix + len("payloads//000-000001000001.dlc.ready") + s.learner_id_bytes
    waiting = 2 * learners * PAYLOADS_WAITING_PER_LEARNER
    poll = listing_bytes(waiting, payload_key)
    sweep, sweep_requests = _sweep(s, learners)
    # garbage collection after each snapshot: list global/updates (up to 2S with markers)
    # and global/snapshots, delete S updates and a snapshot (with their markers)
    snapshots = merges / S
    gc_list = listing_bytes(4 * S, prefix + 39) + listing_bytes(2 * (SNAPSHOTS_KEPT + 1), prefix + 36)
    gc_requests = listing_requests(4 * S) + listing_requests(2 * (SNAPSHOTS_KEPT + 1))
    return (
        _flow("payload", "down", sends * payload, get=sends, delete=deletes),
        _flow("marker", "down", sends * s.payload_marker_bytes, get=sends),
    ), (
        _flow("listing", "down", poll / s.poll_seconds, put=listing_requests(waiting) / s.poll_seconds, polling=True),
        _flow(
            "listing",
            "down",
            sweep + snapshots * gc_list,
            put=sweep_requests + snapshots * gc_requests,
            delete=snapshots * (2 * S + 2),
        ),
    )


def _aggregate_flows(
    shape: RunShape, link: Link, sends: float, merges: float, beat_every: float, samples: float
) -> Flows:
    """With reducers: the region's aggregates, about ``min(sends_r, merges)`` per second
    (:mod:`diloco_cli.runtime.reducer.forwarding`: under K = M one per fragment round,
    under K < M one once the region's share of the quorum arrived), each the size of one
    learner payload of its fragment (the learner codec's), and their markers (one send
    listed per learner send); the listing of ``aggregates/`` per poll; the reducer's
    status each time the heartbeats are read; the listing for leftovers.  The reducer
    deletes what was merged and collects the garbage, in the region."""
    s = shape
    P, learners = s.num_fragments, link.learners
    aggregates = min(sends, merges)
    payload = sum(s.uploads.bytes) / P
    aggregate_key = s.key_prefix_bytes + len("aggregates/000-000001000001.dlc.ready")
    waiting = 2 * P * AGGREGATES_WAITING_PER_FRAGMENT if learners else 0.0
    poll = listing_bytes(waiting, aggregate_key)
    reads = 1 / beat_every if learners else 0.0
    reducer_status = reducer_status_bytes(P, learners, samples, s.learner_id_bytes)
    sweep, sweep_requests = _sweep(s, learners)
    return (
        _flow("aggregate", "down", aggregates * payload, get=aggregates),
        _flow(
            "marker",
            "down",
            aggregates * s.aggregate_marker_bytes + sends * s.aggregate_marker_bytes_per_send,
            get=aggregates,
        ),
        _flow("reducer", "down", reads * reducer_status, get=reads),
    ), (
        _flow("listing", "down", poll / s.poll_seconds, put=listing_requests(waiting) / s.poll_seconds, polling=True),
        _flow("listing", "down", sweep, put=sweep_requests),
    )


def _seconds(flows: tuple[Flow, ...], link: Link) -> float:
    """The syncer's time for ``flows`` on ``link``: bytes over rate, a round trip per request."""
    if not link.wan:
        return 0.0
    round_trip = 2 * link.latency_ms / 1000
    return sum(f.bytes_per_second / link.bytes_per_second + f.requests_per_second * round_trip for f in flows)


def request_overhead(flows: tuple[Flow, ...], protocol: str, path_bytes: float) -> tuple[float, float]:
    """Bytes per second up and down that ``flows``' requests carry besides their objects
    (their HTTP heads, as the meter estimates them: :mod:`diloco_cli.store.wire`); PUT
    and LIST are counted as PUTs."""
    wire = wire_model(protocol)
    up = down = 0.0
    for op, rate in (
        ("write", sum(f.put_per_second for f in flows)),
        ("read", sum(f.get_per_second for f in flows)),
        ("delete", sum(f.delete_per_second for f in flows)),
    ):
        request_up, request_down = wire.per_request(op, path_bytes)
        up, down = up + rate * request_up, down + rate * request_down
    return up, down


def link_traffic(
    shape: RunShape, link: Link, period: float, head: float, status: float, beat: float, samples: float
) -> LinkTraffic:
    flows = link_flows(shape, link, period, head, status, beat, samples)
    heads_up, heads_down = request_overhead(flows, link.protocol, shape.key_prefix_bytes + 40)
    up = sum(f.bytes_per_second for f in flows if f.direction == "up") + heads_up
    down = sum(f.bytes_per_second for f in flows if f.direction == "down") + heads_down
    polling = [f for f in flows if f.polling]
    one_poll = _seconds(
        tuple(
            f.model_copy(
                update={
                    "bytes_per_second": f.bytes_per_second * shape.poll_seconds,
                    "put_per_second": f.put_per_second * shape.poll_seconds,
                }
            )
            for f in polling
        ),
        link,
    )
    return LinkTraffic(
        region=link.region,
        learners=link.learners,
        wan=link.wan,
        rate_mbit=link.rate_mbit,
        latency_ms=link.latency_ms,
        flows=flows,
        up_bytes_per_second=up,
        down_bytes_per_second=down,
        put_per_second=sum(f.put_per_second for f in flows),
        get_per_second=sum(f.get_per_second for f in flows),
        delete_per_second=sum(f.delete_per_second for f in flows),
        utilization=max(up, down) / link.bytes_per_second if link.wan else None,
        syncer_seconds_per_second=_seconds(tuple(f for f in flows if not f.polling), link),
        poll_seconds=one_poll,
    )


PER_ROUND_KINDS = frozenset({"payload", "aggregate", "update", "marker", "head", "snapshot"})
"""Flows that come once per send or merge (the rest come with the clock)."""


def per_round_and_clock_bytes(link: LinkTraffic) -> tuple[float, float]:
    """Both directions of ``link`` per second: its per-round flows
    (:data:`PER_ROUND_KINDS`), and the rest with its requests' heads."""
    rounds = sum(f.bytes_per_second for f in link.flows if f.kind in PER_ROUND_KINDS)
    return rounds, link.up_bytes_per_second + link.down_bytes_per_second - rounds
