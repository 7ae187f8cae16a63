"""The inputs and results of the traffic model (:mod:`diloco_cli.bandwidth.model`): a
run's shape (its links, codecs' costs, schedule and periods) and what is predicted for it,
per link, per flow and for data-parallel beside it."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco_cli.config.recipe import SyncConfig, TrainingConfig

FROZEN = ConfigDict(frozen=True, extra="forbid")

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
    key_prefix_bytes: int = 40
    """Length of the run's root inside a bucket (``runs/<run>/``): listed keys carry it."""
    learner_id_bytes: float = 10.0
    region_name_bytes: float = 8.0

    @property
    def num_learners(self) -> int:
        return sum(link.learners for link in self.links)

    @property
    def relays(self) -> bool:
        """Under K < M each region's reducer relays every send to the syncer as it is;
        under K = M it forwards one aggregate per fragment round."""
        return self.quorum < self.num_learners


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
    """The syncer's time for one listing of this region's arrivals (its reducer's
    aggregates and relays)."""


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
