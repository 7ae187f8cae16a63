"""``diloco simulate goodput``: goodput under failures, simulated (docs/goodput.md)."""

from __future__ import annotations

from pathlib import Path

import typer

from diloco_cli.cli.errors import reported

PLOTS_MISSING = "--plot needs matplotlib: pip install 'diloco-cli[plots]'"
OUTPUT_HELP = """text (a table, plain when piped), json (the whole result on stdout), or
FILE.json (written there; the table still printed). JSON has: constants, seed, chips,
strategies, cells (per size and strategy: goodput, uptime, goodput_replicas,
interruptions_per_day, save_interval_seconds, closed_form_goodput) and calibration (the
source's figures at 1.2M chips beside the simulation)."""

simulate_app = typer.Typer(
    name="simulate",
    help="Simulate a training cluster instead of running one.",
    no_args_is_help=True,
    rich_markup_mode=None,
    add_completion=False,
)


@reported
def goodput(
    chips: list[str] = typer.Option(
        [],
        "--chips",
        "-n",
        metavar="N",
        help="Cluster size in chips, e.g. 150k or 1.2M (repeatable) [default: 150k 300k 600k 1.2M 2.4M].",
    ),
    learners: list[int] = typer.Option(
        [],
        "--learners",
        "-m",
        metavar="M",
        min=1,
        help="Decoupled DiLoCo learner count (repeatable) [default: 1 2 4 8 16].",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="Override a constant, e.g. --set mtbi_chip_hours=4380 (repeatable; every key is printed with the table).",
    ),
    seed: int = typer.Option(
        0, "--seed", metavar="SEED", help="Seed of every replica's random stream: the same seed, the same table."
    ),
    output: str = typer.Option("text", "--output", "-o", metavar="FORMAT", help=OUTPUT_HELP),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        metavar="FILE",
        help="Also draw goodput and uptime against cluster size into FILE.png or FILE.svg (needs matplotlib).",
    ),
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
        typer.echo(grid.to_json())
    else:
        show_goodput(grid)
    if output.endswith(".json"):
        Path(output).write_text(grid.to_json() + "\n")
        typer.echo(f"wrote {output}", err=True)
    if plot is not None:
        draw_goodput_plot(grid, plot)
        typer.echo(f"wrote {plot}", err=True)


def register(app: typer.Typer) -> None:
    simulate_app.command("goodput")(goodput)
    app.add_typer(simulate_app)
