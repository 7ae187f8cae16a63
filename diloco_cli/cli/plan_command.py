"""``diloco plan``: what a run will ask of the network, before it starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.numbers import finite
from diloco_cli.cli.parameters import OUTPUT, PATH, Real, Whole, command, option

MAX_LINK_MBIT = 10_000_000.0
"""10 Tbit/s: beyond any link between regions."""
MAX_LATENCY_MS = 60_000.0
"""A minute one way: beyond any link that still carries a run."""
MAX_STEP_SECONDS = 86_400.0
DEFAULT_STARTUP_SECONDS = 10.0
"""``--startup-seconds`` unless given: a local launch of the default job measured 11-12 s
from ``diloco up`` to the first step on this machine's 2 cores (bench.wan)."""
"""A day per inner step."""

PLAN_JSON_HELP = """JSON has: recipe, model, parameters, step_seconds (step_range_seconds:
the fastest and slowest timed step when measured), tokens_budget,
shape (every input: links, codecs' payload sizes, markers, snapshot), placement
(syncer_region: the region the syncer runs in, null for a place of its own;
wan_bytes_per_token as planned, apart_wan_bytes_per_token: the syncer in its own
place), diloco (per link its flows by kind and direction, bytes/s up and down,
requests/s, utilization; syncer_busy, compute_share, bottleneck, wan_bytes_per_token),
time_to_budget_seconds, data_parallel, bytes_ratio, suggestion, costs."""


def _per_region(values: list[str], option: str, parse: Callable[[str], float]) -> tuple[float | None, dict[str, float]]:
    """``R`` (every region) and ``REGION=R`` (one region) values of a repeatable option."""
    from diloco_cli.config.errors import ConfigError

    plain, by_region = None, {}
    for value in values:
        region, separator, number = value.rpartition("=")
        try:
            parsed = parse(number)
        except ValueError as error:
            given = f"{value!r}: " if separator else ""
            raise ConfigError(f"{option} {given}{error} (or REGION=NUMBER for one region)") from None
        if separator:
            by_region[region] = parsed
        else:
            plain = parsed
    return plain, by_region


@command()
@option("--recipe", type=PATH, help="Recipe file (recipes/*.yaml); default: the built-in default recipe.")
@option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a recipe key, e.g. --set sync.sync_interval=50 (repeatable).",
)
@option(
    "--regions",
    "-r",
    type=PATH,
    help=(
        "Region file: M, the regions and where the syncer runs come from it "
        "(default: the recipe's M over two regions, the syncer in the first)."
    ),
)
@option(
    "--parameters",
    metavar="N",
    type=Whole(1),
    help="Plan an N-parameter model without building it (needs --step-seconds).",
)
@option(
    "--step-seconds",
    metavar="S",
    type=Real(finite(above=0, maximum=MAX_STEP_SECONDS)),
    help="Compute seconds of one inner step (default: measured with a short trial here).",
)
@option(
    "--startup-seconds",
    metavar="S",
    type=Real(finite(minimum=0, maximum=MAX_STEP_SECONDS)),
    default=DEFAULT_STARTUP_SECONDS,
    help=(
        "Seconds from launch to the learners' first step: processes, imports, the model, the data "
        "(about 11 s for the default job on this machine's 2 cores; add SSH bootstrap for remote hosts)."
    ),
)
@option(
    "--link-mbit",
    multiple=True,
    metavar="R",
    help="Each region<->syncer link's rate in Mbit/s, or REGION=R for one region (repeatable) [default: 100].",
)
@option(
    "--latency-ms",
    multiple=True,
    metavar="L",
    help="Each link's one-way latency in ms, or REGION=L (repeatable) [default: 20].",
)
@option(
    "--target-compute-share",
    "target",
    metavar="SHARE",
    type=Real(finite(above=0, maximum=1)),
    default=0.9,
    help="The compute share the suggested H must reach.",
)
@option(
    "--tokens",
    metavar="BUDGET",
    type=Whole(1),
    help="Tokens to train (default: the recipe's M x inner_steps x batch x sequence length).",
)
@option(
    "--prices",
    metavar="FILE",
    type=PATH,
    help="A YAML file of prices overriding the packaged ones (docs/bandwidth.md).",
)
@option("--output", "-o", type=OUTPUT, default="text", help="Plain text, or JSON. " + PLAN_JSON_HELP)
@reported
def plan(
    recipe: Path | None,
    overrides: list[str],
    regions: Path | None,
    parameters: int | None,
    step_seconds: float | None,
    startup_seconds: float,
    link_mbit: list[str],
    latency_ms: list[str],
    target: float,
    tokens: int | None,
    prices: Path | None,
    output: str,
) -> None:
    """Predict a run's traffic per link, its compute share and time to a token budget, and the smallest H that keeps
    the learners busy; synchronous data-parallel training on the same links beside it."""
    from diloco_cli.bandwidth.prices import load_prices
    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan
    from diloco_cli.config.files import load_recipe, load_regions
    from diloco_cli.views.traffic_plan import render_traffic_plan

    loaded = load_recipe(recipe, overrides)
    placed = load_regions(regions) if regions is not None else None
    rate, rates = _per_region(link_mbit, "--link-mbit", finite(above=0, maximum=MAX_LINK_MBIT))
    latency, latencies = _per_region(latency_ms, "--latency-ms", finite(minimum=0, maximum=MAX_LATENCY_MS))
    result = build_traffic_plan(
        loaded,
        placed,
        parameters=parameters,
        step_seconds=step_seconds,
        startup_seconds=startup_seconds,
        link_mbit=100.0 if rate is None else rate,
        region_link_mbit=rates,
        latency_ms=20.0 if latency is None else latency,
        region_latency_ms=latencies,
        target_compute_share=target,
        tokens=tokens,
        prices=load_prices(prices) if prices is not None else None,
        say=lambda line: click.echo(line, err=True),
    )
    click.echo(result.to_json() if output == "json" else render_traffic_plan(result))


def register(app: click.Group) -> None:
    app.add_command(plan)
