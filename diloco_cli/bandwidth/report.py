"""Where a run's bytes went: per link, per learner, per kind, against data-parallel.

Built from what the run's processes report about their own storage calls (learners in
their heartbeats, the syncer in its status; :mod:`diloco_cli.store.metering`).  A learner
talks only to its own region's bucket, so its bytes stay in its region; the syncer talks
to every region's bucket from its own place, so its bytes cross a link unless it runs in
that region.  The data-parallel comparison (at equal tokens, bytes between regions
only) follows :func:`data_parallel_bytes_per_step` and
:func:`hierarchical_wan_bytes_per_step` (docs/bandwidth.md); prices come from :mod:`diloco_cli.bandwidth.prices`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from diloco_cli.bandwidth.ring import (
    data_parallel_bytes_per_step,
    hierarchical_wan_bytes_per_step,
    ring_region_crossings,
)
from diloco_cli.store.documents import Evaluation, Heartbeat, ReducerStatus, SyncerStatus
from diloco_cli.store.metering import KINDS, StorageCounters, Traffic, TrafficSample
from diloco_cli.store.run_spec import SYNCER_PLACE, RunSpec

if TYPE_CHECKING:
    from diloco_cli.bandwidth.prices import PriceTable

# the prices (a table of pydantic models read from a packaged YAML file) are loaded where a
# report is priced: `diloco status` prints its bytes only

REPORT = ConfigDict(frozen=True, extra="forbid")

DELTA_KINDS = ("payload", "update", "snapshot")
"""Kinds that carry tensors: what compression applies to."""


class LinkRow(BaseModel):
    """The traffic of one place with one region's bucket."""

    model_config = REPORT

    source: str
    """Where the calls came from: a region (its learners), or the syncer's place."""
    bucket: str
    """The region whose bucket was called."""
    wan: bool
    """Whether the bytes crossed a link between places (else region-local)."""
    requests: int
    bytes_up: int
    """Bytes written into the bucket: objects, and the requests' heads (estimated)."""
    bytes_down: int
    """Bytes read from it: objects (listings estimated) and the answers' heads (estimated)."""
    overhead_bytes: int = 0
    """Of these, both ways, what the requests carried besides objects: HTTP heads, error
    bodies, envelopes (estimated per request: ``diloco_cli/store/wire.py``)."""
    seconds: float
    """Time spent in these calls, summed over threads."""
    megabytes_per_second: float | None
    """Effective rate while calls were in flight: bytes / seconds."""
    share: float
    """This link's part of every byte the run moved."""
    cost_dollars: float
    """Egress and requests at the bucket's provider's list prices."""
    history: list[TrafficSample] = Field(default_factory=list)
    """Bytes moved (up, down) over time."""
    kinds: dict[str, int] = Field(default_factory=dict)
    """Bytes both ways by kind of object, heads included (they add up to up + down)."""

    @property
    def name(self) -> str:
        return f"{self.source} -> {self.bucket}" if self.source != self.bucket else f"{self.bucket} (in region)"


class LearnerTraffic(BaseModel):
    model_config = REPORT

    learner: str
    region: str
    tokens: int
    delta_bytes_up: int
    """Payloads and their markers written."""
    checkpoint_bytes_up: int
    other_bytes_up: int
    """Heartbeats, control notes, epochs."""
    bytes_down: int
    """Global updates, snapshots, heads and notes read."""
    requests: int
    retries: int
    failures: int


class SyncerTraffic(BaseModel):
    """What one syncer (shard) moved: with every region's bucket, and with its own home."""

    model_config = REPORT

    name: str
    """``syncer``, or a shard's ``syncer-<s>``."""
    place: str
    merges: int
    requests: int
    """To the regions' buckets."""
    bytes_up: int
    bytes_down: int
    home_bytes: int
    """Read and written in its home store (its commits and ledger)."""


class KindRow(BaseModel):
    model_config = REPORT

    kind: str
    requests: int
    bytes_up: int
    bytes_down: int
    """Objects and the requests' heads, as for links."""
    overhead_bytes: int = 0
    """Of these, both ways, the heads and envelopes (estimated per request)."""
    wan_bytes: int
    """Of these bytes, those that crossed a link."""
    cost_dollars: float = 0.0
    """Requests and egress of this kind at list prices (0 unpriced)."""


class Compression(BaseModel):
    model_config = REPORT

    kind: str
    bytes: int
    """What was written."""
    raw_fp32_bytes: int
    """The fp32 size of the same tensors."""

    @property
    def ratio(self) -> float | None:
        return self.raw_fp32_bytes / self.bytes if self.bytes else None


class DataParallelComparison(BaseModel):
    """What synchronous data-parallel would have sent between regions for the same tokens
    (at equal tokens, not equal loss): a flat ring and a hierarchical all-reduce."""

    model_config = REPORT

    parameters: int
    workers: int
    """M: one data-parallel worker per learner."""
    tokens_per_step: int
    """Global batch in tokens: M x batch x sequence length."""
    steps: float
    """Steps to train the run's tokens."""
    bytes_per_worker_step: float
    """2 (M-1)/M x 2 bytes (bf16) x parameters: a ring all-reduce of every step's gradients."""
    total_bytes: float
    """Sent by all workers together: steps x M x bytes per worker-step."""
    region_crossings: int
    """R: hops of a ring placed region by region that cross between regions."""
    wan_bytes: float
    """The flat ring's bytes between regions: steps x crossings x bytes per worker-step."""
    regions: int
    """R: regions that hold learners."""
    hierarchical_wan_bytes: float
    """A hierarchical all-reduce's bytes between regions: steps x R x 2 (R-1)/R x 2 bytes x
    parameters (reduce in each region, a ring of one leader per region, broadcast)."""
    diloco_wan_bytes: int
    """What this run moved across links."""
    formula: str = "bytes per worker per step = 2 (M-1)/M x 2 bytes x parameters"
    hierarchical_formula: str = "bytes between regions per step = R x 2 (R-1)/R x 2 bytes x parameters"

    def _over_diloco(self, wan_bytes: float) -> float | None:
        return wan_bytes / self.diloco_wan_bytes if self.diloco_wan_bytes else None

    @property
    def wan_ratio(self) -> float | None:
        """The flat ring's bytes between regions over this run's across links, at equal tokens."""
        return self._over_diloco(self.wan_bytes)

    @property
    def hierarchical_wan_ratio(self) -> float | None:
        """The hierarchical all-reduce's bytes between regions over this run's, at equal tokens."""
        return self._over_diloco(self.hierarchical_wan_bytes)


class TrafficReport(BaseModel):
    """Everything ``diloco report`` shows."""

    model_config = REPORT

    run: str
    state: str
    elapsed_seconds: float
    tokens: int
    learners_reporting: int
    links: list[LinkRow]
    learners: list[LearnerTraffic]
    syncers: list[SyncerTraffic]
    """The syncer, or each syncer shard (``sync.shards``), as it reported last."""
    kinds: list[KindRow]
    compression: list[Compression]
    data_parallel: DataParallelComparison | None
    """None until the syncer has reported the model's size."""
    evaluations: list[Evaluation]
    started_at: float
    prices_looked_up: str
    cost_note: str
    total_bytes: int
    wan_bytes: int

    @property
    def cost_dollars(self) -> float:
        return sum(link.cost_dollars for link in self.links)

    @property
    def wan_bytes_per_token(self) -> float | None:
        return self.wan_bytes / self.tokens if self.tokens else None


# ---------------------------------------------------------------------------- build


def build_report(
    spec: RunSpec,
    heartbeats: Mapping[str, Heartbeat],
    syncer_statuses: Mapping[str, SyncerStatus],
    prices: PriceTable | None,
    state: str,
    now: float,
    reducers: Iterable[ReducerStatus] = (),
) -> TrafficReport:
    """The report of a run from its processes' latest reports (without ``prices``, every
    cost is 0: ``diloco status`` shows bytes only): the learners', the syncer's (each
    syncer shard's, by process name) and the regions' reducers'.  A region's reducer talks to its own
    bucket only: its bytes stay in the region, beside its learners', and so do those of a
    syncer placed in a region with that region's bucket."""
    syncers = list(syncer_statuses.values())
    region_counts: dict[str, list[StorageCounters]] = {region.name: [] for region in spec.regions}
    for beat in heartbeats.values():
        region_counts.setdefault(beat.region, []).append(beat.storage)
    for reducer in reducers:
        region_counts.setdefault(reducer.region, []).append(reducer.storage)
    by_link: dict[tuple[str, str], list[StorageCounters]] = {
        (name, name): counts for name, counts in region_counts.items() if counts
    }
    for syncer in syncers:  # a syncer in a region shares that region's in-region link
        for name, counts in syncer.storage.items():
            by_link.setdefault((syncer.place, name), []).append(counts)
    sources = [(source, bucket, counts) for (source, bucket), counts in by_link.items()]
    provider = _providers(spec) if prices is not None else {}
    total_bytes = sum(_moved(c.total) for _, _, counts in sources for c in counts)
    links = [_link(source, bucket, counts, total_bytes, prices, provider) for source, bucket, counts in sources]
    wan_bytes = sum(link.bytes_up + link.bytes_down for link in links if link.wan)
    tokens = sum(beat.tokens for beat in heartbeats.values())
    first = syncers[0] if syncers else None
    places = sorted({syncer.place for syncer in syncers}) or [spec.syncer_shards[0].place]
    ended = max((syncer.time for syncer in syncers), default=now) if state in ("finished", "stopped") else now
    return TrafficReport(
        run=spec.run,
        state=state,
        elapsed_seconds=ended - spec.created,
        tokens=tokens,
        learners_reporting=len(heartbeats),
        links=links,
        learners=[_learner(beat) for _, beat in sorted(heartbeats.items())],
        syncers=[_syncer(name, status) for name, status in syncer_statuses.items()],
        kinds=_kinds(sources, prices, provider),
        compression=_compression(heartbeats.values(), syncers),
        data_parallel=_data_parallel(spec, first, tokens, wan_bytes),
        evaluations=list(first.evaluations) if first else [],
        started_at=spec.created,
        prices_looked_up=str(prices.looked_up) if prices else "",
        cost_note=(
            f"list prices looked up {prices.looked_up} ({_prices_note(places)}); "
            "override with --prices FILE (see docs/bandwidth.md)"
        )
        if prices
        else "not priced",
        total_bytes=total_bytes,
        wan_bytes=wan_bytes,
    )


def _prices_note(places: list[str]) -> str:
    if SYNCER_PLACE in places:
        return (
            "the syncer's own place is billed as internet egress; "
            "set syncer.region in the region file if it runs in a region"
        )
    return f"the syncer runs in region {', '.join(places)}"


def _providers(spec: RunSpec) -> dict[str, str | None]:
    """Each region's bucket's provider (``aws``, ``gcp``, ``azure``; None: not a cloud)."""
    from diloco_cli.bandwidth.prices import provider_of

    return {region.name: provider_of(region.root) for region in spec.regions}


def _moved(traffic: Traffic) -> int:
    """Every byte a link carried for ``traffic``: objects and the requests' overhead."""
    return traffic.wire_up + traffic.wire_down


def _dollars(
    traffic: Traffic, source: str, bucket: str, prices: PriceTable | None, provider: Mapping[str, str | None]
) -> float:
    """What ``traffic`` between ``source`` and ``bucket`` costs at list prices (0 unpriced):
    its requests at the bucket's provider, and its egress, reads leaving the bucket's
    network and writes the source's (when it is a region)."""
    if prices is None:
        return 0.0
    from diloco_cli.bandwidth.prices import egress_dollars, request_dollars

    wan = source != bucket
    reads = traffic.requests - traffic.writes - traffic.deletes
    cost = request_dollars(prices, provider[bucket], traffic.writes, reads)
    source_provider = provider.get(source)
    cost += egress_dollars(prices, traffic.wire_down, provider[bucket], source_provider, same_region=not wan)
    cost += egress_dollars(prices, traffic.wire_up, source_provider, provider[bucket], same_region=not wan)
    return cost


def _link(
    source: str,
    bucket: str,
    counts: list[StorageCounters],
    total_bytes: int,
    prices: PriceTable | None,
    provider: Mapping[str, str | None],
) -> LinkRow:
    total = Traffic()
    kinds: dict[str, int] = {}
    for c in counts:
        total = total.plus(c.total)
        for kind, traffic in c.kinds.items():
            kinds[kind] = kinds.get(kind, 0) + _moved(traffic)
    wan = source != bucket
    cost = _dollars(total, source, bucket, prices, provider)
    return LinkRow(
        source=source,
        bucket=bucket,
        wan=wan,
        requests=total.requests,
        bytes_up=total.wire_up,
        bytes_down=total.wire_down,
        overhead_bytes=total.overhead_up + total.overhead_down,
        seconds=round(total.seconds, 3),
        megabytes_per_second=(_moved(total) / total.seconds / 1e6) if total.seconds > 0 else None,
        share=_moved(total) / total_bytes if total_bytes else 0.0,
        cost_dollars=cost,
        history=summed_history([c.history for c in counts]),
        kinds={kind: kinds[kind] for kind in KINDS if kinds.get(kind)},
    )


def summed_history(histories: Iterable[list[TrafficSample]]) -> list[TrafficSample]:
    """Several processes' cumulative byte counts added up at every time any of them was
    sampled (each process's count holds from its sample until its next)."""
    histories = [h for h in histories if h]
    times = sorted({when for h in histories for when, _, _ in h})
    summed: list[TrafficSample] = []
    positions = [0] * len(histories)
    for when in times:
        up = down = 0
        for i, history in enumerate(histories):
            while positions[i] + 1 < len(history) and history[positions[i] + 1][0] <= when:
                positions[i] += 1
            sample = history[positions[i]]
            if sample[0] <= when:
                up, down = up + sample[1], down + sample[2]
        summed.append((when, up, down))
    return summed


def _learner(beat: Heartbeat) -> LearnerTraffic:
    kinds = beat.storage.kinds
    up = {kind: traffic.wire_up for kind, traffic in kinds.items()}
    total = beat.storage.total
    delta = up.get("payload", 0) + up.get("marker", 0)
    checkpoint = up.get("checkpoint", 0)
    return LearnerTraffic(
        learner=beat.learner,
        region=beat.region,
        tokens=beat.tokens,
        delta_bytes_up=delta,
        checkpoint_bytes_up=checkpoint,
        other_bytes_up=total.wire_up - delta - checkpoint,
        bytes_down=total.wire_down,
        requests=total.requests,
        retries=beat.storage.retries,
        failures=beat.storage.failures,
    )


def _syncer(name: str, status: SyncerStatus) -> SyncerTraffic:
    total = Traffic()
    for counts in status.storage.values():
        total = total.plus(counts.total)
    home = status.home_storage.total
    return SyncerTraffic(
        name=name,
        place=status.place,
        merges=status.merges,
        requests=total.requests,
        bytes_up=total.wire_up,
        bytes_down=total.wire_down,
        home_bytes=_moved(home),
    )


def _kinds(
    sources: list[tuple[str, str, list[StorageCounters]]],
    prices: PriceTable | None,
    provider: Mapping[str, str | None],
) -> list[KindRow]:
    rows = []
    for kind in KINDS:
        total, wan, cost = Traffic(), 0, 0.0
        for source, bucket, counts in sources:
            for c in counts:
                if kind in c.kinds:
                    total = total.plus(c.kinds[kind])
                    wan += _moved(c.kinds[kind]) if source != bucket else 0
                    cost += _dollars(c.kinds[kind], source, bucket, prices, provider)
        if total.requests:
            rows.append(
                KindRow(
                    kind=kind,
                    requests=total.requests,
                    bytes_up=total.wire_up,
                    bytes_down=total.wire_down,
                    overhead_bytes=total.overhead_up + total.overhead_down,
                    wan_bytes=wan,
                    cost_dollars=cost,
                )
            )
    return rows


def _compression(heartbeats: Iterable[Heartbeat], syncers: Sequence[SyncerStatus]) -> list[Compression]:
    """Payloads as the learners wrote them; updates and snapshots as the syncer (its
    shards) did."""
    written: dict[str, Traffic] = {kind: Traffic() for kind in DELTA_KINDS}
    for beat in heartbeats:
        written["payload"] = written["payload"].plus(beat.storage.kinds.get("payload", Traffic()))
    for counts in (counts for syncer in syncers for counts in syncer.storage.values()):
        for kind in ("update", "snapshot"):
            written[kind] = written[kind].plus(counts.kinds.get(kind, Traffic()))
    return [
        Compression(kind=kind, bytes=t.bytes_up, raw_fp32_bytes=t.raw_bytes)
        for kind, t in written.items()
        if t.bytes_up
    ]


def _data_parallel(
    spec: RunSpec, syncer: SyncerStatus | None, tokens: int, wan_bytes: int
) -> DataParallelComparison | None:
    if syncer is None or not syncer.parameters:
        return None
    recipe = spec.recipe
    workers = len(spec.learners)
    tokens_per_step = workers * recipe.training.batch_size * recipe.data.sequence_length
    steps = tokens / tokens_per_step
    per_step = data_parallel_bytes_per_step(syncer.parameters, workers)
    per_region = Counter(learner.region for learner in spec.learners)
    crossings = ring_region_crossings(per_region.values())
    return DataParallelComparison(
        parameters=syncer.parameters,
        workers=workers,
        tokens_per_step=tokens_per_step,
        steps=steps,
        bytes_per_worker_step=per_step,
        total_bytes=steps * workers * per_step,
        region_crossings=crossings,
        wan_bytes=steps * crossings * per_step,
        regions=len(per_region),
        hierarchical_wan_bytes=steps * hierarchical_wan_bytes_per_step(syncer.parameters, len(per_region)),
        diloco_wan_bytes=wan_bytes,
    )


def one_line(report: TrafficReport) -> str:
    """The bandwidth summary ``diloco status`` shows."""
    local = report.total_bytes - report.wan_bytes
    parts = [f"{_megabytes(report.wan_bytes)} across links, {_megabytes(local)} in regions"]
    payload = next((c for c in report.compression if c.kind == "payload"), None)
    if payload and payload.ratio:
        parts.append(f"payloads {payload.ratio:.1f}x smaller than fp32")
    dp = report.data_parallel
    if dp and dp.wan_ratio:
        parts.append(
            f"data-parallel would send {dp.wan_ratio:,.0f}x as much between regions "
            f"({dp.hierarchical_wan_ratio:,.0f}x hierarchical), at equal tokens"
        )
    return "bandwidth: " + "; ".join(parts) + f" (diloco report {report.run})"


def _megabytes(count: float) -> str:
    return f"{count / 1e6:,.1f} MB" if count < 1e9 else f"{count / 1e9:,.2f} GB"
