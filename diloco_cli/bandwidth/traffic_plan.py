"""A run's plan: what it will ask of every link, and what it gets done, before it starts.

:func:`build_traffic_plan` takes a recipe (and a region file, or just M and a number of
regions), measures what the formulas of :mod:`diloco_cli.bandwidth.model` need (with
:mod:`diloco_cli.bandwidth.measure`), and returns a frozen :class:`TrafficPlan`:

* the inner step's compute time, from a short trial on this machine (the recipe's
  model and batch, a few warm steps then a few timed ones, on the recipe's device),
  unless ``step_seconds`` is given;
* every payload's real size, by encoding sample tensors of each fragment's shapes with
  the real encoder for every codec it weighs (:func:`weighed_codecs`: fp32, bf16, int8,
  int4) and the recipe's: frame, header, packed values, scales, zstandard.  A fragment
  of more than :data:`~diloco_cli.bandwidth.measure.EXACT_VALUES` values is sized from
  its exact layout and the compression measured on a sample;
* the training thread's time to encode a fragment's delta, to add an update and check
  its digest, and to encode a checkpoint, timed on the same samples.

Then the plan predicts the run on the given links, synchronous data-parallel training
beside it, the smallest H (and codecs) that reach a target compute share, what its
placement (the syncer in a region) saves against the same run with the syncer in a place
of its own, and, where the buckets are in a cloud, what the traffic costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict

from diloco_cli.bandwidth.link_rate import LinkRates, link_rates
from diloco_cli.bandwidth.measure import (
    Sizer,
    _numel,
    _spec_with,
    even_fragments,
    measure_step_seconds,
    model_fragments,
)
from diloco_cli.bandwidth.model import predict, predict_data_parallel, smallest_sync_interval
from diloco_cli.bandwidth.prices import PriceTable, egress_dollars, load_prices, provider_of, request_dollars
from diloco_cli.bandwidth.shapes import CodecCost, DataParallelPrediction, DiLoCoPrediction, Link, RunShape
from diloco_cli.codec import Codec, CodecSpec
from diloco_cli.codec.registry import codec_named
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.aggregates import SendRecord
from diloco_cli.store.filesystem import protocol_of
from diloco_cli.store.region import SEQUENCE_PER_EPOCH, payload_key

FROZEN = ConfigDict(frozen=True, extra="forbid")

NOT_BUILT = "not built (--parameters)"


def weighed_codecs() -> tuple[str, ...]:
    """The codecs a plan weighs for uploads and updates alike, heaviest first: every
    registered codec offered to plans (fp32, bf16, int8, int4 of the built-in ones), by
    the size of a section of 2^16 values with its default parameters."""
    offered = [codec.value for codec in Codec if codec_named(codec).offered_by_plan]
    return tuple(sorted(offered, key=lambda codec: -CodecSpec(codec=codec).layout(1 << 16).total_bytes))


def update_density(recipe: Recipe, regions: int, learners: int) -> float:
    """The share of a published update's values that are not 0: where uploads are sparse
    (top-k: ``keep_per_block`` of each block) and the outer step has no momentum, a merge
    of S sends keeps at most S times the share of each (S: the regions' aggregates under
    K = M, else the learners' sends their reducers relay); else every value moves."""
    codec, sync = recipe.sync.learner_codec, recipe.sync
    if codec.density >= 1 or sync.outer_momentum > 0:
        return 1.0
    relays = (sync.quorum or learners) < learners
    senders = learners if relays else regions
    return min(1.0, senders * codec.density)


"""The plan's ``model`` when it was made from a parameter count alone."""

EXAMPLE_RUN_NAME_SUFFIX = "-20260101-120000"
"""What ``diloco up`` appends to the recipe's name (a date and time): run names are in
every key a listing returns."""


class CodecOption(BaseModel):
    """The smallest H for one choice of codecs."""

    model_config = FROZEN

    upload_codec: str
    update_codec: str
    sync_interval: int | None
    """The smallest H that reaches the target; None when no H up to inner_steps does."""
    compute_share: float
    """At that H (or at H = inner_steps when none reaches the target)."""


class Suggestion(BaseModel):
    """The smallest H, and the codecs, that reach the target compute share."""

    model_config = FROZEN

    target_compute_share: float
    reached: bool
    """False when no H up to the recipe's inner_steps reaches the target with any codec:
    the plan then names the best it found (H = inner_steps, the lightest codecs)."""
    sync_interval: int
    upload_codec: str
    update_codec: str
    compute_share: float
    half_interval: int | None
    """H/2, to show that it does not reach the target (None when H = 1)."""
    half_interval_compute_share: float | None
    options: tuple[CodecOption, ...]
    """Every choice of codecs weighed, each with its smallest H."""


class LinkCost(BaseModel):
    model_config = FROZEN

    region: str
    provider: str | None
    """The bucket's provider (None: not in a cloud, free)."""
    egress_dollars_per_hour: float
    """Bytes read by the syncer (billed to the bucket's provider) and written by it (billed
    to the syncer's, when it runs in a cloud)."""
    request_dollars_per_hour: float


class Costs(BaseModel):
    model_config = FROZEN

    looked_up: str
    """When the prices were written down (see ``prices.yaml``)."""
    syncer_provider: str | None
    syncer_region: str | None
    links: tuple[LinkCost, ...]
    diloco_dollars_per_hour: float
    diloco_dollars_to_budget: float
    data_parallel_dollars_per_hour: float
    """Ring all-reduce egress between workers in different regions."""
    data_parallel_dollars_to_budget: float


class Placement(BaseModel):
    """Where the syncer runs, and what that placement saves: the run's WAN bytes per token
    beside the same run with the syncer in a place of its own."""

    model_config = FROZEN

    syncer_region: str | None
    """The region whose network the syncer is in (its link is local), or None: a place of
    its own, every region's link crossing the WAN."""
    syncer_shards: int = 1
    """Syncer processes sharing the fragments (``sync.shards``); their bytes are the one
    syncer's, planned where ``syncer.host`` puts it (the merge work and the requests in
    flight are shared out)."""
    wan_bytes_per_token: float
    """As planned (``diloco.wan_bytes_per_token``)."""
    apart_wan_bytes_per_token: float
    """The syncer in a place of its own: every region's link crosses the WAN."""


class TrafficPlan(BaseModel):
    """What a run will ask of the network, and what it gets done."""

    model_config = FROZEN

    recipe: str
    model: str
    """The model's factory, or ``not built (--parameters)`` when planned from a count."""
    parameters: int
    fragment_parameters: tuple[int, ...]
    step_seconds: float
    """t: compute time of one inner step."""
    step_measured_on: str | None
    """Where t was measured (cpu, cuda), or None when given."""
    step_range_seconds: tuple[float, float] | None
    """The fastest and slowest timed step when t was measured (t is their median), or None."""
    step_measurement_noisy: bool
    """The timed steps differed by more than a quarter of their median."""
    tokens_per_step: int
    """Tokens one learner trains per inner step."""
    tokens_budget: int
    link_mbit: dict[str, float | None]
    latency_ms: dict[str, float]
    shape: RunShape
    """Everything the prediction was computed from (payload sizes included)."""
    placement: Placement
    diloco: DiLoCoPrediction
    time_to_budget_seconds: float
    data_parallel: DataParallelPrediction
    data_parallel_time_to_budget_seconds: float
    bytes_ratio: float
    """Data-parallel WAN bytes per token over Decoupled DiLoCo's."""
    suggestion: Suggestion
    link_rates: LinkRates
    """The WAN link rate each method needs to keep its learners computing 90% of wall time."""
    costs: Costs | None
    """None when no bucket is in a cloud."""

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


# --------------------------------------------------------------------------- layout


class _Region(BaseModel):
    name: str
    learners: int
    learner_ids: tuple[str, ...]
    bucket: str | None
    key_prefix_bytes: int


def _layout(
    recipe: Recipe, regions: RegionsFile | None, num_learners: int | None, num_regions: int | None, run: str
) -> tuple[list[_Region], str | None, str | None]:
    """The regions with their learners, and the syncer's (region, provider): the region
    file's placement (:meth:`RegionsFile.syncer_region`), or without one the default's,
    the first region."""
    if regions is None:
        learners = num_learners or recipe.training.num_learners
        default = RegionsFile()
        if num_regions is None and default.num_learners == learners:
            regions = default
        else:
            count = min(num_regions or len(default.regions), learners)
            if count < 1:
                raise ConfigError("a plan needs at least one region")
            found = []
            for index in range(count):
                share = learners // count + (index < learners % count)
                name = f"region-{index}"
                found.append(
                    _Region(
                        name=name,
                        learners=share,
                        learner_ids=tuple(f"{name}-{n}" for n in range(share)),
                        bucket=None,
                        key_prefix_bytes=len(f"runs/{run}/"),
                    )
                )
            return found, found[0].name, None  # the default placement: the syncer in the first region
    elif num_learners is not None and num_learners != regions.num_learners:
        raise ConfigError(
            f"the region file places {regions.num_learners} learners; leave M to it (it was asked for {num_learners})"
        )
    placements = regions.learner_placements()
    found = []
    for region in regions.regions:
        ids = tuple(learner for learner, where, _ in placements if where.name == region.name)
        root = region.run_root(run, "runs")
        path = root.split("://", 1)[1] if "://" in root else root
        within = path.split("/", 1)[1] if "/" in path else ""  # the key prefix after the bucket's name
        found.append(
            _Region(
                name=region.name,
                learners=len(ids),
                learner_ids=ids,
                bucket=region.bucket,
                key_prefix_bytes=len(within) + 1,
            )
        )
    syncer_region = regions.syncer_region()
    if syncer_region is not None:
        syncer_provider = provider_of(regions.region(syncer_region).bucket)
    else:
        syncer_provider = provider_of(regions.syncer.home)
    return found, syncer_region, syncer_provider


def _per_region(value: float, by_region: Mapping[str, float] | None, names: list[str], what: str) -> dict[str, float]:
    by_region = dict(by_region or {})
    unknown = sorted(set(by_region) - set(names))
    if unknown:
        raise ConfigError(f"{what} names region(s) {', '.join(unknown)}; the regions are {', '.join(names)}")
    return {name: float(by_region.get(name, value)) for name in names}


def _links(
    layout: list[_Region], rates: dict[str, float], latencies: dict[str, float], syncer_region: str | None
) -> tuple[Link, ...]:
    """Each region's link to the syncer: local (no rate, no latency) for the syncer's own region."""
    return tuple(
        Link(
            region=r.name,
            learners=r.learners,
            rate_mbit=None if r.name == syncer_region else rates[r.name],
            latency_ms=0.0 if r.name == syncer_region else latencies[r.name],
            protocol=protocol_of(r.bucket) if r.bucket else "s3",
        )
        for r in layout
    )


def _placement(
    shape: RunShape, diloco: DiLoCoPrediction, apart: tuple[Link, ...], syncer_region: str | None, shards: int
) -> Placement:
    """The planned placement's WAN bytes per token beside the same run with the syncer
    on ``apart`` links (every one over the WAN)."""
    return Placement(
        syncer_region=syncer_region,
        syncer_shards=shards,
        wan_bytes_per_token=diloco.wan_bytes_per_token,
        apart_wan_bytes_per_token=predict(shape.model_copy(update={"links": apart})).wan_bytes_per_token,
    )


# ----------------------------------------------------------------------------- plan


def _recipe_with(
    recipe: Recipe,
    num_learners: int | None,
    sync_interval: int | None,
    num_fragments: int | None,
    learner_codec: str | None,
    update_codec: str | None,
) -> Recipe:
    data = recipe.model_dump(mode="json")
    if num_learners is not None:
        data["training"]["num_learners"] = num_learners
        if recipe.sync.quorum is not None and recipe.sync.quorum > num_learners:
            raise ConfigError(f"sync.quorum K={recipe.sync.quorum} cannot exceed the {num_learners} learners planned")
    for key, value in (("sync_interval", sync_interval), ("num_fragments", num_fragments)):
        if value is not None:
            data["sync"][key] = value
    for key, codec in (("learner_codec", learner_codec), ("update_codec", update_codec)):
        if codec is not None:
            data["sync"][key] = _spec_with(getattr(recipe.sync, key), codec).model_dump(mode="json")
    try:
        return Recipe.model_validate(data)
    except ValueError as error:
        raise ConfigError(f"the planned recipe is not valid: {error}") from None


def build_traffic_plan(
    recipe: Recipe,
    regions: RegionsFile | None = None,
    *,
    num_regions: int | None = None,
    num_learners: int | None = None,
    sync_interval: int | None = None,
    num_fragments: int | None = None,
    learner_codec: str | None = None,
    update_codec: str | None = None,
    parameters: int | None = None,
    step_seconds: float | None = None,
    startup_seconds: float = 0.0,
    link_mbit: float = 100.0,
    region_link_mbit: Mapping[str, float] | None = None,
    latency_ms: float = 20.0,
    region_latency_ms: Mapping[str, float] | None = None,
    target_compute_share: float = 0.9,
    tokens: int | None = None,
    bytes_per_value: int = 2,
    prices: PriceTable | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> TrafficPlan:
    """Plan a run of ``recipe`` on links of ``link_mbit`` Mbit/s and ``latency_ms``
    one-way latency between each region's bucket and the syncer (per region with the
    ``region_*`` mappings).  ``regions`` places the learners (M and regions from it);
    without it M learners (``num_learners`` or the recipe's) are spread over
    ``num_regions`` regions (default: the default region file's).  ``parameters`` plans
    an N-parameter model without building it (then ``step_seconds`` is needed);
    ``startup_seconds`` pass before the learners' first step.  The token budget defaults
    to the recipe's: M x inner_steps x batch x sequence length.  Without ``step_seconds``
    the step is measured here, and ``say`` is told what is measured and how it went.
    """
    if parameters is not None and step_seconds is None:
        raise ConfigError("--parameters plans without building the model: give --step-seconds too")
    if not 0 < target_compute_share <= 1:
        raise ConfigError(f"the target compute share must be in (0, 1], got {target_compute_share}")
    if not all(0 < v < math.inf for v in (link_mbit, *(region_link_mbit or {}).values())):
        raise ConfigError("link rates must be positive and finite (Mbit/s)")
    if not all(0 <= v < math.inf for v in (latency_ms, *(region_latency_ms or {}).values())):
        raise ConfigError("latencies must be finite and not negative (ms)")
    learners = regions.num_learners if regions is not None else num_learners
    recipe = _recipe_with(recipe, learners, sync_interval, num_fragments, learner_codec, update_codec)
    sync, training = recipe.sync, recipe.training
    run = recipe.name + EXAMPLE_RUN_NAME_SUFFIX
    layout, syncer_region, syncer_provider = _layout(recipe, regions, num_learners, num_regions, run)
    names = [region.name for region in layout]
    rates = _per_region(link_mbit, region_link_mbit, names, "a link rate")
    latencies = _per_region(latency_ms, region_latency_ms, names, "a latency")
    links = _links(layout, rates, latencies, syncer_region)
    M, P = sum(r.learners for r in layout), sync.num_fragments
    K = recipe.quorum

    # what the model is, and how long a step takes
    if parameters is not None:
        fragments, model_name = even_fragments(parameters, P), NOT_BUILT
    else:
        fragments, model_name = model_fragments(recipe, P), recipe.model.factory
    sizes = [sum(_numel(shape) for _, shape in fragment) for fragment in fragments]
    total = sum(sizes)
    timing = None
    if step_seconds is None:
        timing = measure_step_seconds(recipe, say=say)
        step_seconds = timing.median
    if not 0 < step_seconds < math.inf:
        raise ConfigError(f"the step time must be positive and finite, got {step_seconds}")
    tokens_per_step = training.batch_size * recipe.data.sequence_length
    budget = tokens if tokens is not None else M * training.inner_steps * tokens_per_step
    if budget <= 0:
        raise ConfigError(f"the token budget must be positive, got {budget}")

    # what every payload weighs, for every codec
    sizer = Sizer(seed=training.seed)
    learner_id = max((ids for r in layout for ids in r.learner_ids), key=len, default="learner-0")
    version = M // K * P * training.inner_steps // sync.sync_interval + 1
    upload_meta = {
        "learner": learner_id,
        "step": training.inner_steps,
        "loss": 1.2345678901234567,
        "sent_at": 1.7e9 + 0.123456,
        "fragment": P - 1,
        "base_version": version,
        "c_steps": sync.sync_interval,
        "c_tokens": sync.sync_interval * tokens_per_step,
    }
    update_meta = {
        "fragment": P - 1,
        "version": version,
        "merged": [learner_id] * K,
        "time": 1.7e9 + 0.123456,
        "previous_version": version - P,
    }
    uploads, updates = {}, {}
    for codec in dict.fromkeys((*weighed_codecs(), sync.learner_codec.codec.value, sync.update_codec.codec.value)):
        for kind, spec, meta, found in (
            ("upload", sync.learner_codec, upload_meta, uploads),
            ("update", sync.update_codec, update_meta, updates),
        ):
            density = 1.0 if kind == "upload" else update_density(recipe, len(layout), M)
            measured = [sizer.measure(kind, fragment, _spec_with(spec, codec), meta, density) for fragment in fragments]
            found[codec] = CodecCost(
                codec=codec, bytes=tuple(b for b, _ in measured), seconds=tuple(s for _, s in measured)
            )
    upload_codec, publish_codec = sync.learner_codec.codec.value, sync.update_codec.codec.value
    sequence = 9 * SEQUENCE_PER_EPOCH + version  # a send in epoch 9: a learner restarted a few times
    payload_marker = sizer.marker_bytes(
        {
            **{k: upload_meta[k] for k in ("step", "loss", "sent_at", "base_version", "c_steps", "c_tokens")},
            "learner": learner_id,
            "fragment": P - 1,
            "sequence": sequence,
            "bytes": max(uploads[upload_codec].bytes),
        }
    )
    send = SendRecord(
        payload_key(LearnerId(learner_id), FragmentIndex(P - 1), sequence),
        LearnerId(learner_id),
        sequence,
        Version(version),
        sync.sync_interval,
        sync.sync_interval * tokens_per_step,
    )

    def aggregate_marker(sends: int) -> int:
        """The marker of an aggregate holding ``sends`` sends (``store.aggregates.write_aggregate``)."""
        return sizer.marker_bytes(
            {
                "fragment": P - 1,
                "serial": sequence,
                "anchor": version,
                "sends": [send.to_json()] * sends,
                "resync": [],
                "bytes": max(uploads[upload_codec].bytes),
            }
        )

    shape = RunShape(
        links=links,
        quorum=K,
        sync_interval=sync.sync_interval,
        sync_interval_schedule=sync.sync_interval_schedule,
        num_fragments=P,
        inner_steps=training.inner_steps,
        step_seconds=step_seconds,
        startup_seconds=startup_seconds,
        tokens_per_step=tokens_per_step,
        uploads=uploads[upload_codec],
        updates=updates[publish_codec],
        payload_marker_bytes=payload_marker,
        aggregate_marker_bytes=aggregate_marker(0),
        aggregate_marker_bytes_per_send=aggregate_marker(1) - aggregate_marker(0),
        update_marker_bytes=sizer.marker_bytes({"version": version, "fragment": P - 1}),
        snapshot_bytes=sizer.snapshot_bytes(
            fragments, {"version": version, "fragment_versions": {str(p): version - p for p in range(P)}}
        ),
        snapshot_marker_bytes=sizer.marker_bytes({"version": version}),
        checkpoint_seconds=sizer.checkpoint_seconds(total),
        checkpoint_every_steps=training.checkpoint_every_steps,
        snapshot_every=sync.snapshot_every,
        evaluate_every=sync.evaluate_every,
        poll_seconds=sync.poll_seconds,
        heartbeat_seconds=training.heartbeat_seconds,
        status_seconds=sync.status_seconds,
        leftover_seconds=sync.leftover_seconds,
        key_prefix_bytes=max((r.key_prefix_bytes for r in layout), default=0),
        learner_id_bytes=sum(len(i) for r in layout for i in r.learner_ids) / max(1, M),
        region_name_bytes=sum(len(n) for n in names) / len(names),
    )
    diloco = predict(shape)
    apart = _links(layout, rates, latencies, None)
    placement = _placement(shape, diloco, apart, syncer_region, recipe.sync.shards)
    data_parallel = predict_data_parallel(total, links, step_seconds, tokens_per_step, bytes_per_value)
    suggestion = _suggest(shape, uploads, updates, target_compute_share)
    costs = _costs(prices, layout, syncer_region, syncer_provider, diloco, data_parallel, budget)
    return TrafficPlan(
        recipe=recipe.name,
        model=model_name,
        parameters=total,
        fragment_parameters=tuple(sizes),
        step_seconds=step_seconds,
        step_measured_on=timing.device if timing else None,
        step_range_seconds=(min(timing.steps), max(timing.steps)) if timing else None,
        step_measurement_noisy=timing.noisy if timing else False,
        tokens_per_step=tokens_per_step,
        tokens_budget=budget,
        link_mbit={link.region: link.rate_mbit for link in links},
        latency_ms={link.region: link.latency_ms for link in links},
        shape=shape,
        placement=placement,
        diloco=diloco,
        time_to_budget_seconds=startup_seconds + budget / diloco.useful_tokens_per_second,
        data_parallel=data_parallel,
        data_parallel_time_to_budget_seconds=budget / data_parallel.tokens_per_second,
        bytes_ratio=data_parallel.wan_bytes_per_token / diloco.wan_bytes_per_token
        if diloco.wan_bytes_per_token
        else math.inf,
        suggestion=suggestion,
        link_rates=link_rates(shape, total, bytes_per_value, target_compute_share),
        costs=costs,
    )


def _suggest(
    shape: RunShape, uploads: dict[str, CodecCost], updates: dict[str, CodecCost], target: float
) -> Suggestion:
    """The smallest H reaching ``target`` with any codecs weighed; at that H the recipe's
    codecs when they reach it too, else the lightest that do."""
    recipe_pair = (shape.uploads.codec, shape.updates.codec)
    weighed = weighed_codecs()
    pairs = list(dict.fromkeys([*((c, c) for c in weighed), recipe_pair]))
    largest = shape.inner_steps
    options, found = [], {}
    for upload, update in pairs:
        candidate = shape.model_copy(update={"uploads": uploads[upload], "updates": updates[update]})
        best = smallest_sync_interval(candidate, target, largest)
        if best is None:
            share = predict(candidate.model_copy(update={"sync_interval": largest})).compute_share
            options.append(
                CodecOption(upload_codec=upload, update_codec=update, sync_interval=None, compute_share=share)
            )
        else:
            options.append(
                CodecOption(
                    upload_codec=upload,
                    update_codec=update,
                    sync_interval=best.sync_interval,
                    compute_share=best.compute_share,
                )
            )
            found[(upload, update)] = (best.sync_interval, candidate)
    if not found:
        lightest = (weighed[-1], weighed[-1])
        option = next(o for o in options if (o.upload_codec, o.update_codec) == lightest)
        return Suggestion(
            target_compute_share=target,
            reached=False,
            sync_interval=largest,
            upload_codec=lightest[0],
            update_codec=lightest[1],
            compute_share=option.compute_share,
            half_interval=None,
            half_interval_compute_share=None,
            options=tuple(options),
        )
    interval = min(h for h, _ in found.values())
    at_best = [pair for pair, (h, _) in found.items() if h == interval]
    weight = lambda pair: sum(uploads[pair[0]].bytes) + sum(updates[pair[1]].bytes)  # noqa: E731
    chosen = recipe_pair if recipe_pair in at_best else min(at_best, key=weight)
    candidate = found[chosen][1]
    share = predict(candidate.model_copy(update={"sync_interval": interval})).compute_share
    half = interval // 2 if interval > 1 else None
    half_share = predict(candidate.model_copy(update={"sync_interval": half})).compute_share if half else None
    return Suggestion(
        target_compute_share=target,
        reached=True,
        sync_interval=interval,
        upload_codec=chosen[0],
        update_codec=chosen[1],
        compute_share=share,
        half_interval=half,
        half_interval_compute_share=half_share,
        options=tuple(options),
    )


def _costs(
    prices: PriceTable | None,
    layout: list[_Region],
    syncer_region: str | None,
    syncer_provider: str | None,
    diloco: DiLoCoPrediction,
    data_parallel: DataParallelPrediction,
    budget: int,
) -> Costs | None:
    providers = {r.name: provider_of(r.bucket) for r in layout}
    if not any(providers.values()) and syncer_provider is None:
        return None
    prices = prices or load_prices()
    links = []
    for link in diloco.links:
        provider, same = providers[link.region], link.region == syncer_region
        egress = egress_dollars(prices, link.down_bytes_per_second, provider, syncer_provider, same) + egress_dollars(
            prices, link.up_bytes_per_second, syncer_provider, provider, same
        )
        requests = request_dollars(prices, provider, link.put_per_second, link.get_per_second)
        links.append(
            LinkCost(
                region=link.region,
                provider=provider,
                egress_dollars_per_hour=3600 * egress,
                request_dollars_per_hour=3600 * requests,
            )
        )
    per_hour = sum(c.egress_dollars_per_hour + c.request_dollars_per_hour for c in links)
    # data-parallel: each worker sends bytes_per_step to the next one around the ring
    ring = [r.name for r in layout for _ in range(r.learners)]
    per_step = (
        sum(
            egress_dollars(prices, data_parallel.bytes_per_step, providers[here], providers[there], here == there)
            for here, there in zip(ring, ring[1:] + ring[:1])
        )
        if len(ring) > 1
        else 0.0
    )
    dp_per_hour = 3600 * per_step / data_parallel.step_seconds
    return Costs(
        looked_up=prices.looked_up.isoformat(),
        syncer_provider=syncer_provider,
        syncer_region=syncer_region,
        links=tuple(links),
        diloco_dollars_per_hour=per_hour,
        diloco_dollars_to_budget=per_hour * budget / diloco.useful_tokens_per_second / 3600,
        data_parallel_dollars_per_hour=dp_per_hour,
        data_parallel_dollars_to_budget=dp_per_hour * budget / data_parallel.tokens_per_second / 3600,
    )
