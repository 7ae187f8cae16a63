"""``diloco simulate goodput``: goodput under failures, simulated (docs/goodput.md)."""

from __future__ import annotations

from pathlib import Path

import click

from diloco_cli.cli.errors import reported
from diloco_cli.cli.parameters import PATH, Whole, command, option

PLOTS_MISSING = "--plot needs matplotlib: pip install 'diloco-cli[plots]'"
OUTPUT_HELP = """text (a table, plain when piped), json (the whole result on stdout), or
FILE.json (written there; the table still printed). JSON has: constants, seed, chips,
strategies, cells (per size and strategy: goodput, uptime, goodput_replicas,
interruptions_per_day, save_interval_seconds, closed_form_goodput) and calibration (the
source's figures at 1.2M chips beside the simulation)."""

simulate_app = click.Group(
    name="simulate", help="Simulate a training cluster instead of running one.", no_args_is_help=True
)


@command(name="goodput")
@option(
    "--chips",
    "-n",
    multiple=True,
    metavar="N",
    help="Cluster size in chips, e.g. 150k or 1.2M (repeatable) [default: 150k 300k 600k 1.2M 2.4M].",
)
@option(
    "--learners",
    "-m",
    multiple=True,
    metavar="M",
    type=Whole(1),
    help="Decoupled DiLoCo learner count (repeatable) [default: 1 2 4 8 16].",
)
@option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a constant, e.g. --set mtbi_chip_hours=4380 (repeatable; every key is printed with the table).",
)
@option(
    "--seed",
    metavar="SEED",
    type=Whole(),
    default=0,
    help="Seed of every replica's random stream: the same seed, the same table.",
)
@option("--output", "-o", metavar="FORMAT", default="text", help=OUTPUT_HELP)
@option(
    "--plot",
    metavar="FILE",
    type=PATH,
    help="Also draw goodput and uptime against cluster size into FILE.png or FILE.svg (needs matplotlib).",
)
@reported
def goodput(
    chips: list[str], learners: list[int], overrides: list[str], seed: int, output: str, plot: Path | None
) -> None:
    """Goodput and uptime of plain data-parallel, elastic data-parallel and Decoupled DiLoCo with M learners on
    clusters of 150k to 2.4M chips whose chips each fail about once a year: an event-driven simulation, calibrated to
    the source's figures at 1.2M chips."""
    import importlib.util

    from diloco_cli.config.errors import ConfigError
    from diloco_cli.config.loading import load_model
    from diloco_cli.simulate import GoodputConstants, parse_chip_count, simulate_grid
    from diloco_cli.simulate.constants import DEFAULT_CHIPS, DEFAULT_LEARNERS
    from diloco_cli.simulate.grid import check_grid
    from diloco_cli.views.simulate import draw_goodput_plot, show_goodput

    if output not in ("text", "json") and not output.endswith(".json"):
        raise ConfigError(f"--output {output!r}: expected text, json or a file name ending in .json")
    if plot is not None:
        if plot.suffix.lower() not in (".png", ".svg"):
            raise ConfigError(f"--plot {plot}: expected a file name ending in .png or .svg")
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError(PLOTS_MISSING)
    constants = load_model(GoodputConstants, None, overrides, default_name="the simulation's constants")
    try:
        sizes = [parse_chip_count(text) for text in chips] or list(DEFAULT_CHIPS)
    except ValueError as error:
        raise ConfigError(f"--chips {error}") from None
    counts = learners or list(DEFAULT_LEARNERS)
    try:
        check_grid(constants, sizes, counts)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    grid = simulate_grid(constants, seed=seed, chips=sizes, learners=counts)
    if output == "json":
        click.echo(grid.to_json())
    else:
        show_goodput(grid)
    if output.endswith(".json"):
        Path(output).write_text(grid.to_json() + "\n")
        click.echo(f"wrote {output}", err=True)
    if plot is not None:
        draw_goodput_plot(grid, plot)
        click.echo(f"wrote {plot}", err=True)


def register(app: click.Group) -> None:
    simulate_app.add_command(goodput)
    app.add_command(simulate_app)
