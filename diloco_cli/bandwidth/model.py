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

* down, with reducers (``sync.reducers``, the default): the region's aggregates, about
  min(M_r P/(H T), merges) of them (one per fragment round under K = M), each the size
  of one learner payload of its fragment, and their markers (which list the sends they
  hold); a listing of ``aggregates/`` per poll; the heartbeats, and the reducer's status
  as often; a listing of the whole run now and then (leftovers).  The learners' payloads,
  the snapshots and the garbage collection stay in the region.
* down, without reducers: each of the M_r learners' payloads, P every H steps, and their
  markers; its heartbeats (one each every ``status_seconds``, 2 s); a listing of
  ``payloads/`` per poll; a listing of the whole run now and then (leftovers) and of
  ``global/`` per snapshot (garbage).
* up: per merge (K = M: P/(H T) merges per second; K < M: up to M/K times as many) the
  update and its marker, the head; without reducers a snapshot and its marker every S
  merges; the syncer's status every ``status_seconds`` (2 s).

The syncer decides on one thread but calls every region's bucket at once, each region's
calls in order; so besides each link's utilization (its busier direction over its
capacity) the model counts the syncer's *I/O time* per second on its slowest link:
bytes over rate plus a round trip (2 x one-way latency) per request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco_cli.bandwidth.document_sizes import (
    head_bytes,
    heartbeat_bytes,
    history_samples,
    reducer_status_bytes,
    status_bytes,
)
from diloco_cli.config.recipe import SyncConfig, TrainingConfig
from diloco_cli.core.fragments import sends_per_learner
from diloco_cli.store.metering import LIST_PAGE_KEYS, LISTING_BYTES_PER_KEY, LISTING_BYTES_PER_REQUEST
from diloco_cli.store.wire import wire_model

FROZEN = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

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

# ---------------------------------------------------------------------------- inputs


class Link(BaseModel):
    """The link between one region's bucket and the syncer."""

    model_config = FROZEN

    region: str
    learners: int = Field(ge=0)
    """M_r: learners in this region."""
    rate_mbit: float | None = Field(gt=0)
    """Capacity in Mbit/s, each direction; None when the syncer runs in this region (a
    local link, neither limited nor part of the WAN)."""
    latency_ms: float = Field(ge=0)
    """One-way latency; a request costs a round trip, twice this."""
    protocol: str = "s3"
    """The protocol of the region's bucket (``s3``, ``gs``, ``file``...): what each request
    carries besides its object, its HTTP heads (:mod:`diloco_cli.store.wire`)."""

    @property
    def wan(self) -> bool:
        return self.rate_mbit is not None

    @property
    def bytes_per_second(self) -> float:
        return math.inf if self.rate_mbit is None else self.rate_mbit * 1e6 / 8


class CodecCost(BaseModel):
    """What one codec costs for one kind of payload, fragment by fragment."""

    model_config = FROZEN

    codec: str
    """fp32, bf16, int8 or int4."""
    bytes: tuple[int, ...]
    """The payload's size for each fragment (frame, header, body, tag)."""
    seconds: tuple[float, ...]
    """The learner's training-thread time for each fragment: encoding its delta (upload
    codec), or adding an update and checking the digest (update codec)."""


def recipe_default(config: type[BaseModel], name: str) -> Any:
    """The default of the recipe setting ``name`` in ``config`` (``TrainingConfig``,
    ``SyncConfig``): what a run uses when its recipe leaves the key out."""
    return config.model_fields[name].default


class RunShape(BaseModel):
    """Everything the traffic of a run depends on."""

    model_config = FROZEN

    links: tuple[Link, ...]
    quorum: int = Field(ge=1)
    sync_interval: int = Field(ge=1)
    sync_interval_schedule: tuple[tuple[int, int], ...] = ()
    """Smaller H early: ``(until_step, H)`` stages (``sync.sync_interval_schedule``); the
    steady rates are at ``sync_interval``, the run's sends count the stages."""
    num_fragments: int = Field(ge=1)
    inner_steps: int = Field(ge=1)
    step_seconds: float = Field(gt=0)
    """t: compute time of one inner step."""
    startup_seconds: float = Field(default=0.0, ge=0)
    """S: from the launch to the learners' first step (processes, imports, the model, the
    data): no learner computes, the syncer already polls."""
    tokens_per_step: int = Field(ge=1)
    """Tokens one learner trains per inner step (batch x sequence length)."""
    uploads: CodecCost
    updates: CodecCost
    payload_marker_bytes: int
    aggregate_marker_bytes: int
    """An aggregate's marker holding no send (fragment, serial, anchor, size)."""
    aggregate_marker_bytes_per_send: int
    """What each send an aggregate holds adds to its marker (payload key, learner,
    sequence, base version, counters)."""
    update_marker_bytes: int
    snapshot_bytes: int
    snapshot_marker_bytes: int
    checkpoint_seconds: float = 0.0
    """Training-thread time to encode one checkpoint."""
    # The run's settings: their defaults are the recipe's (one source of truth).
    checkpoint_every_steps: int = recipe_default(TrainingConfig, "checkpoint_every_steps")
    snapshot_every: int = recipe_default(SyncConfig, "snapshot_every")
    evaluate_every: int = recipe_default(SyncConfig, "evaluate_every")
    poll_seconds: float = recipe_default(SyncConfig, "poll_seconds")
    """The syncer's poll interval."""
    heartbeat_seconds: float = recipe_default(TrainingConfig, "heartbeat_seconds")
    status_seconds: float = recipe_default(SyncConfig, "status_seconds")
    """How often the syncer writes its status to every region and reads the heartbeats
    (``sync.status_seconds``; heartbeats at most as often as learners write them)."""
    leftover_seconds: float = recipe_default(SyncConfig, "leftover_seconds")
    delete_consumed_payloads: bool = recipe_default(SyncConfig, "delete_consumed_payloads")
    reducers: bool = recipe_default(SyncConfig, "reducers")
    """A reducer in every region (``sync.reducers``): the syncer reads the regions'
    aggregates instead of the learners' payloads, and writes no snapshot."""
    key_prefix_bytes: int = 40
    """Length of the run's root inside a bucket (``runs/<run>/``): listed keys carry it."""
    learner_id_bytes: float = 10.0
    region_name_bytes: float = 8.0

    @property
    def num_learners(self) -> int:
        return sum(link.learners for link in self.links)


# --------------------------------------------------------------------------- results


class Flow(BaseModel):
    """One kind of object crossing one link in one direction."""

    model_config = FROZEN

    kind: str
    """payload, aggregate, marker, heartbeat, reducer (its status), listing, update,
    snapshot, head, status (the kinds of ``store.metering``)."""
    direction: Literal["up", "down"]
    """Seen from the syncer: up is written to the bucket, down read from it."""
    bytes_per_second: float
    put_per_second: float
    """PUT and LIST requests (S3's PUT/COPY/POST/LIST tier, GCS class A)."""
    get_per_second: float
    """GET and HEAD requests (S3's GET tier, GCS class B)."""
    delete_per_second: float
    """DELETE requests (free at the three providers)."""
    polling: bool = False
    """A listing the syncer makes every poll: it stretches when the syncer is busy."""

    @property
    def requests_per_second(self) -> float:
        return self.put_per_second + self.get_per_second + self.delete_per_second


class LinkTraffic(BaseModel):
    """What one region's link carries, per second."""

    model_config = FROZEN

    region: str
    learners: int
    wan: bool
    rate_mbit: float | None
    latency_ms: float
    flows: tuple[Flow, ...]
    up_bytes_per_second: float
    down_bytes_per_second: float
    put_per_second: float
    get_per_second: float
    delete_per_second: float
    utilization: float | None
    """The busier direction's bytes over the capacity; None for a local link."""
    syncer_seconds_per_second: float
    """The syncer's I/O time on this link per second, polling listings left out."""
    poll_seconds: float
    """The syncer's time for one listing of this region's arrivals (payloads, or with
    reducers aggregates)."""


class DiLoCoPrediction(BaseModel):
    """A Decoupled DiLoCo run on the given links."""

    model_config = FROZEN

    num_learners: int
    quorum: int
    sync_interval: int
    num_fragments: int
    upload_codec: str
    update_codec: str
    step_seconds: float
    """t: compute of one inner step."""
    overhead_seconds: float
    """o: the training thread's time per step for sends, installs and checkpoints:
    ``(sum_p encode_p + (M/K) sum_p install_p) / H + checkpoint / every``."""
    period_seconds: float
    """T = t + o: one inner step of a learner, which never waits for the network."""
    sends_per_second: float
    """Payloads all learners upload: M P / (H T)."""
    merges_per_second: float
    """Versions the syncer publishes: (M/K) P / (H T)."""
    cpu_share: float
    """t / T: compute over the training thread's time."""
    links: tuple[LinkTraffic, ...]
    syncer_busy: float
    """The syncer's I/O time per second: every link's flows (bytes over rate, a round
    trip per request) plus one listing of every region per merge."""
    network_factor: float
    """min(1, 1/utilization of every WAN link, 1/syncer_busy): the share of the
    learners' work that the links and the syncer can carry."""
    compute_share: float
    """cpu_share x network_factor: useful compute over the training loop's wall time."""
    compute_share_with_startup: float
    """compute_share over all wall time, start-up included: x ``I T / (S + I T)`` for I
    inner steps."""
    bottleneck: str
    """none, ``link <region> (up|down)``, or ``syncer I/O``."""
    trained_tokens_per_second: float
    useful_tokens_per_second: float
    wan_bytes_per_second: float
    """Up and down, summed over the WAN links, at the rates the run asks for."""
    wan_bytes_per_token: float
    """wan_bytes_per_second over trained tokens per second."""
    rounds_per_learner: float
    """Sends each learner makes over its inner steps: every fragment on its staggered
    schedule, and once more at the end for each fragment trained since its last send
    (the end-of-run flush), where the steady rates count P x inner_steps / H."""
    rounds_crossing_per_learner: float
    """Of these, the rounds that reach a merge: ``rounds_per_learner x network_factor``.
    Where a link or the syncer is the bottleneck the learners go on computing, their
    outboxes fold the sends that wait into newer ones and the syncer merges less often:
    only this many rounds' bytes cross."""
    run_wan_bytes: float
    """The whole run's WAN bytes: the per-round flows (payloads or aggregates, updates,
    markers, heads) for ``rounds_crossing_per_learner``, the rest (heartbeats, status,
    listings) at their rates over the start-up and the learners' inner steps."""
    head_bytes: float
    status_bytes: float
    heartbeat_bytes: float


class DataParallelPrediction(BaseModel):
    """Synchronous data-parallel training (ring all-reduce) of the same model on the same links."""

    model_config = FROZEN

    workers: int
    """W: one worker per learner."""
    parameters: int
    bytes_per_value: int
    formula: str
    bytes_per_step: float
    """What each worker sends (and receives) per step: 2(W-1)/W x bytes_per_value x N."""
    slowest_link_mbit: float | None
    latency_ms: float
    allreduce_seconds: float
    """bytes_per_step over the slowest WAN link + 2(W-1) x latency."""
    step_seconds: float
    """t + allreduce (no overlap of compute and communication)."""
    compute_share: float
    tokens_per_second: float
    region_crossings: int
    """R: hops of the ring between regions (:func:`ring_region_crossings`)."""
    wan_bytes_per_token: float
    """R x bytes_per_step over W x tokens per worker step: only the hops between regions
    cross the WAN, each byte once."""


# ------------------------------------------------------------------------ formulas


def data_parallel_bytes_per_step(parameters: float, workers: int, bytes_per_value: float = 2) -> float:
    """What each worker sends, and receives, per step in a ring all-reduce::

        2 (W - 1) / W x bytes_per_value x parameters

    (a reduce-scatter then an all-gather, each W-1 steps of 1/W of the gradient).  The
    reference every report compares Decoupled DiLoCo's traffic with."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    return 2 * (workers - 1) / workers * bytes_per_value * parameters


def ring_region_crossings(learners_per_region: Iterable[int]) -> int:
    """How many hops of a ring all-reduce cross from one region to another: a ring that
    visits the regions in turn (as a placement by region gives) crosses once into each of
    the R regions that hold workers, and not at all when they are all in one region.  Each
    crossing carries one worker's :func:`data_parallel_bytes_per_step` each step, so the
    bytes between regions per step are ``crossings x bytes_per_step``."""
    regions = sum(1 for learners in learners_per_region if learners > 0)
    return regions if regions > 1 else 0


def hierarchical_wan_bytes_per_step(parameters: float, regions: int, bytes_per_value: float = 2) -> float:
    """What a hierarchical (region-aware) all-reduce sends between regions per step: each
    region reduces inside, one leader per region joins a ring all-reduce of the R leaders,
    and each leader broadcasts inside its region.  Only the leaders' ring crosses, each of
    its R hops carrying :func:`data_parallel_bytes_per_step` of R workers::

        R x 2 (R - 1) / R x bytes_per_value x parameters

    The strongest synchronous baseline on a WAN (a flat ring sends 2 (M-1)/M per crossing)."""
    if regions <= 1:
        return 0.0
    return regions * data_parallel_bytes_per_step(parameters, regions, bytes_per_value)


def ring_allreduce_seconds(
    bytes_per_step: float, workers: int, rate_bytes_per_second: float, latency_seconds: float
) -> float:
    """One ring all-reduce: ``bytes_per_step / rate + 2 (W - 1) x latency`` (every one of
    the 2(W-1) steps waits for its neighbour's chunk)."""
    if workers <= 1:
        return 0.0
    return bytes_per_step / rate_bytes_per_second + 2 * (workers - 1) * latency_seconds


def overhead_seconds(shape: RunShape) -> float:
    """o, the training thread's time per inner step beside compute::

        (sum_p encode_p + (M/K) sum_p install_p) / H  +  checkpoint / checkpoint_every

    (every fragment is encoded once per H steps; every merged version of it, M/K per H
    steps, is added and checked)."""
    ratio = shape.num_learners / shape.quorum
    per_interval = sum(shape.uploads.seconds) + ratio * sum(shape.updates.seconds)
    return per_interval / shape.sync_interval + shape.checkpoint_seconds / shape.checkpoint_every_steps


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


def predict(shape: RunShape) -> DiLoCoPrediction:
    """Traffic per link, compute share and token rates of a Decoupled DiLoCo run.

    ``T = t + o``; per second M P/(H T) payloads are sent and (M/K) P/(H T) versions
    published (with reducers, about min(M_r P/(H T), merges) aggregates cross from each
    region instead of its M_r P/(H T) payloads); each link carries the flows of
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
