"""``diloco simulate goodput``: goodput under failures, simulated (docs/goodput.md)."""

from __future__ import annotations

import io
import sys
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
        [], "--learners", "-m", metavar="M", help="Decoupled DiLoCo learner count (repeatable) [default: 1 2 4 8 16]."
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
        show_table(grid)
    if output.endswith(".json"):
        Path(output).write_text(grid.to_json() + "\n")
        typer.echo(f"wrote {output}", err=True)
    if plot is not None:
        draw_plot(grid, plot)
        typer.echo(f"wrote {plot}", err=True)


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def _strategy_label(name: str) -> str:
    return name.replace("diloco", "DiLoCo")


def _constant_value(name: str, value: object) -> str:
    if value is None:
        return "Daly's optimum" if name == "checkpoint_interval_seconds" else "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_view(grid, plain: bool = False):
    """The table (goodput % / uptime % per size and strategy), the calibration line and
    every constant with the first sentence of its description."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from diloco_cli.simulate.constants import chip_label

    constants = grid.constants
    replicas = f"{constants.replicas} replica{'' if constants.replicas == 1 else 's'}"
    title = f"goodput % / uptime % ({constants.horizon_days:g} days x {replicas} per cell, seed {grid.seed})"
    table = Table(box=box.SIMPLE if plain else box.SIMPLE_HEAVY, show_edge=False)
    table.add_column("chips", justify="right")
    for name in grid.strategies:
        table.add_column(_strategy_label(name), justify="right", no_wrap=True)
    for chips in grid.chips:
        row = [chip_label(chips)]
        for name in grid.strategies:
            cell = grid.cell(chips, name)
            row.append(f"{_percent(cell.goodput)} / {_percent(cell.uptime)}")
        table.add_row(*row)
    parts: list = [Text(title), table]
    if grid.calibration:
        compared = ", ".join(
            f"{_strategy_label(point.strategy)} {_percent(point.simulated)}% (source {100 * point.source:g}%)"
            for point in grid.calibration
        )
        parts.append(Text(f"at 1.2M chips: {compared}"))
    fields = type(constants).model_fields
    described = Table(
        box=None,
        title="constants (override with --set KEY=VALUE; docs/goodput.md)",
        title_justify="left",
        show_header=False,
        pad_edge=False,
    )
    described.add_column("key", no_wrap=True)
    described.add_column("value", justify="right", no_wrap=True)
    described.add_column("meaning")
    for name, field in fields.items():
        first_sentence = " ".join((field.description or "").replace("``", "").split()).split(". ")[0].rstrip(".")
        described.add_row(name, _constant_value(name, getattr(constants, name)), first_sentence)
    parts += [Text(""), described]
    return Group(*parts)


def render_plain(grid, width: int = 150) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False, highlight=False)
    console.print(build_view(grid, plain=True))
    return "".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines())


def show_table(grid) -> None:
    if sys.stdout.isatty():
        from rich.console import Console

        Console().print(build_view(grid))
    else:
        typer.echo(render_plain(grid), nl=False)


def draw_plot(grid, path: Path) -> None:
    """Goodput and uptime against cluster size, one line per strategy, the source's
    figures at 1.2M chips as crosses."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    from diloco_cli.simulate.constants import chip_label

    figure = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    goodput_axes, uptime_axes = figure.subplots(1, 2, sharex=True)
    for name in grid.strategies:
        cells = [grid.cell(chips, name) for chips in grid.chips]
        line = goodput_axes.plot(grid.chips, [cell.goodput for cell in cells], marker="o", label=_strategy_label(name))[
            0
        ]
        uptime_axes.plot(grid.chips, [cell.uptime for cell in cells], marker="o", color=line.get_color())
        for point in grid.calibration:
            if point.strategy == name:
                goodput_axes.plot(
                    [1_200_000], [point.source], marker="x", markersize=10, color=line.get_color(), linestyle="none"
                )
    for axes, label in ((goodput_axes, "goodput (x: the source at 1.2M chips)"), (uptime_axes, "uptime")):
        axes.set_xscale("log")
        axes.set_xticks(grid.chips)
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: chip_label(round(value))))
        axes.xaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        axes.yaxis.set_major_formatter(PercentFormatter(1.0))
        axes.set_ylim(0, 1.02)
        axes.set_xlabel("chips")
        axes.set_title(label)
        axes.grid(True, alpha=0.3)
    goodput_axes.legend(fontsize="small")
    mtbi = grid.constants.mtbi_chip_hours
    figure.suptitle(f"Simulated goodput under failures (per-chip MTBI {mtbi:g} h, seed {grid.seed})")
    figure.savefig(path)


def register(app: typer.Typer) -> None:
    simulate_app.command("goodput")(goodput)
    app.add_typer(simulate_app)
