"""What ``diloco plan`` prints: a run's traffic per link, its compute share, time and cost."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco_cli.bandwidth.link_rate import OBJECT_SECONDS
from diloco_cli.views.format import human_bytes, human_duration

if TYPE_CHECKING:
    from diloco_cli.bandwidth.traffic_plan import TrafficPlan


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.3f}"


def _dollars(value: float) -> str:
    return f"${value:,.2f}" if value >= 1 or value == 0 else f"${value:.4f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _per_token(count: float) -> str:
    """Bytes per token: tenths of a byte below 100 B."""
    return f"{count:.1f} B" if abs(count) < 100 else human_bytes(count)


def _placement(plan: TrafficPlan) -> str:
    """Where the syncer runs (a reducer is beside every region's bucket)."""
    p = plan.placement
    who = "the syncer" if p.syncer_shards == 1 else f"the syncer ({p.syncer_shards} shards)"
    syncer = (
        f"{who} in region {p.syncer_region} (its link is local)"
        if p.syncer_region is not None
        else f"{who} in a place of its own (every region's link crosses the WAN)"
    )
    return f"placement: {syncer}, a reducer beside each region's bucket"


def _other_placements(plan: TrafficPlan) -> list[str]:
    """The same run's WAN bytes per token with the syncer in a place of its own: what
    this placement saves."""
    p = plan.placement
    if p.syncer_region is None:
        return []
    ratio = f" ({p.apart_wan_bytes_per_token / p.wan_bytes_per_token:.1f}x)" if p.wan_bytes_per_token else ""
    return [f"  placed otherwise {_per_token(p.apart_wan_bytes_per_token)} with the syncer in its own place{ratio}"]


def _rate(rate: float | None) -> str:
    if rate is None:
        return "none reaches it"
    return f"{rate:.3g} Mbit/s" if rate < 1000 else f"{rate / 1000:.3g} Gbit/s"


def _link_rates(plan: TrafficPlan) -> list[str]:
    rates = plan.link_rates

    def times(ratio: float | None) -> str:
        return f" ({ratio:,.0f}x Decoupled DiLoCo's)" if ratio else ""

    return [
        f"Link rate for {_share(rates.target_compute_share)} computing (every WAN link alike, each way)",
        f"  Decoupled DiLoCo {_rate(rates.diloco_mbit)}"
        + (
            f" (the largest update must cross in one request within {OBJECT_SECONDS:g} s, s3fs's read timeout)"
            if rates.diloco_mbit is not None and rates.diloco_mbit <= rates.diloco_object_mbit
            else ""
        ),
        f"  data-parallel    {_rate(rates.flat_ring_mbit)} flat ring{times(rates.flat_ring_over_diloco)}, "
        f"{_rate(rates.hierarchical_mbit)} hierarchical{times(rates.hierarchical_over_diloco)}",
    ]


def _codec_change(plan: TrafficPlan) -> list[str]:
    """A line when the suggestion's codecs are not the recipe's: what to set to follow it."""
    s, d = plan.suggestion, plan.diloco
    changes = [
        f"sync.{key}.codec={suggested}"
        for key, suggested, recipe in (
            ("learner_codec", s.upload_codec, d.upload_codec),
            ("update_codec", s.update_codec, d.update_codec),
        )
        if suggested != recipe
    ]
    if not changes:
        return []
    return [
        f"                   this changes the recipe's codecs (uploads {d.upload_codec}, updates {d.update_codec}): "
        + " ".join(f"--set {change}" for change in changes)
    ]


def render_traffic_plan(plan: TrafficPlan) -> str:
    """The plan as a few lines and a table per link."""
    shape, d, dp, s = plan.shape, plan.diloco, plan.data_parallel, plan.suggestion
    fragments = " + ".join(f"{n:,}" for n in plan.fragment_parameters)
    step = "given"
    if plan.step_range_seconds is not None:
        fastest, slowest = plan.step_range_seconds
        step = f"measured on {plan.step_measured_on}: the median, {fastest:.3f}-{slowest:.3f} s" + (
            "; noisy: plan again on an idle machine or give --step-seconds" if plan.step_measurement_noisy else ""
        )
    lines = [
        f"plan for {plan.recipe}: {plan.parameters:,} parameters in {d.num_fragments} fragments ({fragments}), "
        f"model {plan.model}",
        f"M={d.num_learners} learners in {len(d.links)} regions, K={d.quorum}, H={d.sync_interval}, "
        f"P={d.num_fragments}, "
        f"uploads {d.upload_codec}, updates {d.update_codec}, snapshot every {shape.snapshot_every} versions",
        f"inner step {d.step_seconds:.3f} s ({step}); "
        f"training-thread overhead {1000 * d.overhead_seconds:.2f} ms/step (encode, install, checkpoint)",
        f"payloads per fragment: upload {' + '.join(human_bytes(b) for b in shape.uploads.bytes)}, "
        f"update {' + '.join(human_bytes(b) for b in shape.updates.bytes)}; "
        f"snapshot {human_bytes(shape.snapshot_bytes)}",
        f"budget {plan.tokens_budget:,} tokens",
        _placement(plan),
        "",
        f"{'region<->syncer':<18} {'learners':>8} {'Mbit/s':>7} {'ms':>5} {'up MB/s':>8} {'down MB/s':>9} "
        f"{'util':>6} {'PUT+LIST/s':>10} {'GET/s':>6} {'DEL/s':>6}",
    ]
    for link in d.links:
        rate = f"{link.rate_mbit:g}" if link.rate_mbit is not None else "local"
        lines.append(
            f"{link.region:<18} {link.learners:>8} {rate:>7} {link.latency_ms:>5g} "
            f"{_megabytes(link.up_bytes_per_second):>8} "
            f"{_megabytes(link.down_bytes_per_second):>9} {_share(link.utilization):>6} {link.put_per_second:>10.2f} "
            f"{link.get_per_second:>6.2f} {link.delete_per_second:>6.2f}"
        )
    lines.append(
        f"syncer I/O {_share(d.syncer_busy)} busy "
        "(its slowest region: bytes over rate plus a round trip per request; regions are called at once)"
    )
    steady = d.num_fragments * shape.inner_steps / d.sync_interval
    loop = shape.inner_steps * d.period_seconds
    lines += [
        "",
        "Decoupled DiLoCo",
        f"  computing        {_share(d.cpu_share)} of the training loop (learners never wait for the network); "
        f"{_share(d.cpu_share * loop / (loop + shape.startup_seconds))} of all wall time with "
        f"{shape.startup_seconds:g} s of start-up",
        f"  useful share     {_share(d.compute_share)} "
        f"(the share of that work the links and syncer carry to a merge on time; bottleneck: {d.bottleneck})",
        f"  time to budget   {human_duration(plan.time_to_budget_seconds)}",
        f"  WAN bytes/token  {_per_token(d.wan_bytes_per_token)} "
        f"({human_bytes(d.wan_bytes_per_second)}/s over all links)",
        f"  WAN bytes, run   {human_bytes(d.run_wan_bytes)} ({d.rounds_per_learner:g} sends per learner, the end's "
        f"flush included; {steady:g} at the steady rate"
        + (
            f"; {d.rounds_crossing_per_learner:.3g} reach a merge, the rest folded into later sends by the "
            f"{d.bottleneck} bottleneck)"
            if d.network_factor < 1
            else ")"
        ),
        *_other_placements(plan),
    ]
    if s.reached:
        half = f"; H={s.half_interval}: {_share(s.half_interval_compute_share)}" if s.half_interval else ""
        lines.append(
            f"  smallest H       H={s.sync_interval} keeps {_share(s.compute_share)} useful (the target: "
            f"{_share(s.target_compute_share)}) with uploads {s.upload_codec}, updates {s.update_codec}{half}"
        )
        lines += _codec_change(plan)
        recipe = f"the recipe's H={d.sync_interval}: {_share(d.compute_share)}"
        lines.append(
            f"                   the smallest H these links carry; any larger one does too ({recipe}): "
            "a larger H sends fewer bytes, a smaller one merges more often"
            if d.sync_interval >= s.sync_interval
            else f"                   {recipe}, below it: set sync.sync_interval to {s.sync_interval} or more "
            "for these links"
        )
    else:
        lines.append(
            f"  smallest H       none reaches {_share(s.target_compute_share)} with H up to {s.sync_interval}; "
            f"best: H={s.sync_interval}, uploads {s.upload_codec}, updates {s.update_codec}: {_share(s.compute_share)}"
        )
        lines += _codec_change(plan)
    lines.append(
        "  smallest H by codecs: "
        + ", ".join(
            f"{o.upload_codec}/{o.update_codec} {o.sync_interval if o.sync_interval else '-'}" for o in s.options
        )
    )
    lines += [
        f"Data-parallel (ring all-reduce, W={dp.workers}, {dp.bytes_per_value}-byte gradients, "
        "every hop over the slowest link)",
        f"  bytes per step   {human_bytes(dp.bytes_per_step)} per worker each way = {dp.formula}",
        f"  step time        {d.step_seconds:.3f} + {dp.allreduce_seconds:.3f} s all-reduce = {dp.step_seconds:.3f} s",
        f"  compute share    {_share(dp.compute_share)}",
        f"  time to budget   {human_duration(plan.data_parallel_time_to_budget_seconds)}",
        f"  WAN bytes/token  {human_bytes(dp.wan_bytes_per_token)} "
        f"({dp.region_crossings} of the ring's {dp.workers} hops between regions): "
        f"{plan.bytes_ratio:.1f}x Decoupled DiLoCo's",
    ]
    lines += _link_rates(plan)
    if plan.costs is not None:
        c = plan.costs
        lines += [
            "",
            f"Costs (list prices written down {c.looked_up}; "
            f"syncer in {c.syncer_region or c.syncer_provider or 'no cloud'})",
        ]
        for link in c.links:
            lines.append(
                f"  {link.region:<18} {link.provider or 'local':<6} egress {_dollars(link.egress_dollars_per_hour)}/h, "
                f"requests {_dollars(link.request_dollars_per_hour)}/h"
            )
        lines.append(
            f"  Decoupled DiLoCo {_dollars(c.diloco_dollars_per_hour)}/h, "
            f"{_dollars(c.diloco_dollars_to_budget)} to the budget"
        )
        lines.append(
            f"  data-parallel    {_dollars(c.data_parallel_dollars_per_hour)}/h, "
            f"{_dollars(c.data_parallel_dollars_to_budget)} to the budget"
        )
    return "\n".join(lines)
