"""``diloco plan``: what a run will ask of the network, before it starts."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_cli.cli.errors import reported
from diloco_cli.cli.runs_commands import Output

PLAN_JSON_HELP = """JSON has: recipe, model, parameters, step_seconds, tokens_budget,
shape (every input: links, codecs' payload sizes, markers, snapshot), diloco (per link
its flows by kind and direction, bytes/s up and down, requests/s, utilization; syncer_busy,
compute_share, bottleneck, wan_bytes_per_token), time_to_budget_seconds, data_parallel,
bytes_ratio, suggestion, costs."""


def _per_region(values: list[str], option: str) -> tuple[float | None, dict[str, float]]:
    """``R`` (every region) and ``REGION=R`` (one region) values of a repeatable option."""
    from diloco_cli.config.errors import ConfigError

    plain, by_region = None, {}
    for value in values:
        region, separator, number = value.rpartition("=")
        try:
            parsed = float(number)
        except ValueError:
            raise ConfigError(f"{option} {value!r}: expected a number, or REGION=NUMBER for one region") from None
        if separator:
            by_region[region] = parsed
        else:
            plain = parsed
    return plain, by_region


@reported
def plan(
    recipe: Path | None = typer.Option(
        None, "--recipe", help="Recipe file (recipes/*.yaml); default: the built-in default recipe."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", metavar="KEY=VALUE", help="Override a recipe key, e.g. --set sync.sync_interval=50 (repeatable)."
    ),
    regions: Path | None = typer.Option(
        None,
        "--regions",
        "-r",
        help=(
            "Region file: M, the regions and where the syncer runs come from it "
            "(default: the recipe's M over two regions)."
        ),
    ),
    parameters: int | None = typer.Option(
        None, "--parameters", metavar="N", help="Plan an N-parameter model without building it (needs --step-seconds)."
    ),
    step_seconds: float | None = typer.Option(
        None,
        "--step-seconds",
        metavar="S",
        help="Compute seconds of one inner step (default: measured with a short trial here).",
    ),
    link_mbit: list[str] = typer.Option(
        [],
        "--link-mbit",
        metavar="R",
        help="Each region<->syncer link's rate in Mbit/s, or REGION=R for one region (repeatable) [default: 100].",
    ),
    latency_ms: list[str] = typer.Option(
        [],
        "--latency-ms",
        metavar="L",
        help="Each link's one-way latency in ms, or REGION=L (repeatable) [default: 20].",
    ),
    target: float = typer.Option(
        0.9, "--target-compute-share", metavar="SHARE", help="The compute share the suggested H must reach."
    ),
    tokens: int | None = typer.Option(
        None,
        "--tokens",
        metavar="BUDGET",
        help="Tokens to train (default: the recipe's M x inner_steps x batch x sequence length).",
    ),
    prices: Path | None = typer.Option(
        None, "--prices", metavar="FILE", help="A YAML file of prices overriding the packaged ones (docs/bandwidth.md)."
    ),
    output: Output = typer.Option(Output.TEXT, "--output", "-o", help="Plain text, or JSON. " + PLAN_JSON_HELP),
) -> None:
    """Predict a run's traffic per link, its compute share and time to a token budget, and the smallest H that keeps
    the learners busy; synchronous data-parallel training on the same links beside it."""
    from diloco_cli.bandwidth.plan import build_plan
    from diloco_cli.bandwidth.prices import load_prices
    from diloco_cli.config.loading import load_model
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile

    loaded = load_model(Recipe, recipe, overrides, default_name="the default recipe")
    placed = load_model(RegionsFile, regions) if regions is not None else None
    rate, rates = _per_region(link_mbit, "--link-mbit")
    latency, latencies = _per_region(latency_ms, "--latency-ms")
    result = build_plan(
        loaded,
        placed,
        parameters=parameters,
        step_seconds=step_seconds,
        link_mbit=100.0 if rate is None else rate,
        region_link_mbit=rates,
        latency_ms=20.0 if latency is None else latency,
        region_latency_ms=latencies,
        target_compute_share=target,
        tokens=tokens,
        prices=load_prices(prices) if prices is not None else None,
    )
    typer.echo(result.to_json() if output is Output.JSON else render_plan(result))


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.3f}"


def _dollars(value: float) -> str:
    return f"${value:,.2f}" if value >= 1 or value == 0 else f"${value:.4f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render_plan(plan) -> str:
    """The plan as a few lines and a table per link."""
    from diloco_cli.views.format import human_bytes, human_duration

    shape, d, dp, s = plan.shape, plan.diloco, plan.data_parallel, plan.suggestion
    fragments = " + ".join(f"{n:,}" for n in plan.fragment_parameters)
    step = f"measured on {plan.step_measured_on}" if plan.step_measured_on else "given"
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
    lines += [
        "",
        "Decoupled DiLoCo",
        f"  computing        {_share(d.cpu_share)} of wall time (learners never wait for the network)",
        f"  useful share     {_share(d.compute_share)} "
        f"(the share of that work the links and syncer carry to a merge on time; bottleneck: {d.bottleneck})",
        f"  time to budget   {human_duration(plan.time_to_budget_seconds)}",
        f"  WAN bytes/token  {human_bytes(d.wan_bytes_per_token)} "
        f"({human_bytes(d.wan_bytes_per_second)}/s over all links)",
    ]
    if s.reached:
        half = f" (H={s.half_interval}: {_share(s.half_interval_compute_share)})" if s.half_interval else ""
        lines.append(
            f"  suggested        H={s.sync_interval}, uploads {s.upload_codec}, updates {s.update_codec}: "
            f"{_share(s.compute_share)} >= {_share(s.target_compute_share)}{half}"
        )
    else:
        lines.append(
            f"  suggested        none reaches {_share(s.target_compute_share)} with H up to {s.sync_interval}; "
            f"best: H={s.sync_interval}, uploads {s.upload_codec}, updates {s.update_codec}: {_share(s.compute_share)}"
        )
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


def register(app: typer.Typer) -> None:
    app.command()(plan)
