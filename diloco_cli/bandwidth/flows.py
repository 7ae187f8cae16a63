"""The flows on each link of a Decoupled DiLoCo run: what the syncer reads of every
region (its reducer's aggregates or relays, the heartbeats) and writes there per second
(the notation and the list of flows are in :mod:`diloco_cli.bandwidth.model`), each request's HTTP heads, and
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
    what arrives and its listings (:func:`_arrival_flows`: the region's aggregates under
    K = M, the sends its reducer relays under K < M), the heartbeats, then what the syncer
    publishes (each region's reducer writes the region's snapshots)."""
    s = shape
    P, learners = s.num_fragments, link.learners
    sends = learners * P / (s.sync_interval * period)
    merges = s.num_learners / s.quorum * P / (s.sync_interval * period)
    update = sum(s.updates.bytes) / P
    beat_every = _turn_interval(min(s.status_seconds, s.heartbeat_seconds), s.poll_seconds)
    status_every = _turn_interval(s.status_seconds, s.poll_seconds)
    beats = learners / beat_every
    arrivals, listings = _arrival_flows(s, link, sends, merges, beat_every, samples)
    return (
        *arrivals,
        _flow("heartbeat", "down", beats * beat, get=beats),
        *listings,
        # publish_update first checks that the marker is not there (a HEAD)
        _flow("update", "up", merges * update, put=merges, get=merges),
        _flow("marker", "up", merges * s.update_marker_bytes, put=merges),
        _flow("head", "up", merges * head, put=merges),
        _flow("status", "up", status / status_every, put=1 / status_every),
    )


def _sweep(shape: RunShape, learners: int) -> tuple[float, float]:
    """Bytes and LIST requests per second of listing one region's whole run for
    leftovers, every ``leftover_seconds / 4``.  Its keys: manifest, head, status, per
    learner its heartbeat, epoch, checkpoints and waiting payloads (and under K < M their
    relays), the updates (1.5 S on average) and snapshots, the aggregates waiting, the
    reducer's error feedback, its status and its epoch."""
    waiting = PAYLOADS_WAITING_PER_LEARNER * (2 if shape.relays else 1)
    keys = (
        3
        + learners * (2 + 2 * CHECKPOINTS_KEPT + 2 * waiting)
        + 2 * 1.5 * shape.snapshot_every
        + 2 * SNAPSHOTS_KEPT
        + 2 * shape.num_fragments * (AGGREGATES_WAITING_PER_FRAGMENT + RESIDUALS_KEPT_PER_FRAGMENT)
        + 2
    )
    every = max(1.0, shape.leftover_seconds / SWEEP_FRACTION)
    return listing_bytes(keys, shape.key_prefix_bytes + 40) / every, listing_requests(keys) / every


def _arrival_flows(
    shape: RunShape, link: Link, sends: float, merges: float, beat_every: float, samples: float
) -> Flows:
    """What the syncer reads of a region (:mod:`diloco_cli.core.forwarding`):
    under K = M the region's aggregates, about ``min(sends_r, merges)`` per second (one
    per fragment round), each the size of one learner payload of its fragment (the
    learner codec's), and their markers (one send listed per learner send); under K < M
    every send its reducer relays, a payload and its marker, which the syncer deletes
    once merged.  Then a listing of ``aggregates/`` and one of ``relays/`` per poll; the
    reducer's status each time the heartbeats are read; the listing for leftovers.  The
    learners' payloads, the snapshots and the garbage collection stay in the region."""
    s = shape
    P, learners = s.num_fragments, link.learners
    payload = sum(s.uploads.bytes) / P
    if s.relays:
        arrivals = (
            _flow("aggregate", "down", sends * payload, get=sends, delete=2 * sends),
            _flow("marker", "down", sends * s.payload_marker_bytes, get=sends),
        )
        relay_key = s.key_prefix_bytes + len("relays//000-000001000001.dlc.ready") + s.learner_id_bytes
        aggregates_waiting, relays_waiting = 0.0, 2 * learners * PAYLOADS_WAITING_PER_LEARNER
    else:
        aggregates = min(sends, merges)
        arrivals = (
            _flow("aggregate", "down", aggregates * payload, get=aggregates),
            _flow(
                "marker",
                "down",
                aggregates * s.aggregate_marker_bytes + sends * s.aggregate_marker_bytes_per_send,
                get=aggregates,
            ),
        )
        relay_key = 0.0
        aggregates_waiting = 2 * P * AGGREGATES_WAITING_PER_FRAGMENT if learners else 0.0
        relays_waiting = 0.0
    aggregate_key = s.key_prefix_bytes + len("aggregates/000-000001000001.dlc.ready")
    poll = listing_bytes(aggregates_waiting, aggregate_key) + listing_bytes(relays_waiting, relay_key)
    poll_requests = listing_requests(aggregates_waiting) + listing_requests(relays_waiting)
    reads = 1 / beat_every if learners else 0.0
    reducer_status = reducer_status_bytes(P, learners, samples, s.learner_id_bytes)
    sweep, sweep_requests = _sweep(s, learners)
    return (
        *arrivals,
        _flow("reducer", "down", reads * reducer_status, get=reads),
    ), (
        _flow("listing", "down", poll / s.poll_seconds, put=poll_requests / s.poll_seconds, polling=True),
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
