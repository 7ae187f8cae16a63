"""What ``diloco simulate goodput`` shows: goodput % / uptime % per cluster size and
strategy, the calibration against the source, every constant, and the plot."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Group

    from diloco_cli.simulate.grid import GoodputGrid


def _percent(value: float) -> str:
    return f"{100 * value:.1f}"


def _strategy_label(name: str) -> str:
    return name.replace("diloco", "DiLoCo")


def _constant_value(name: str, value: object) -> str:
    if value is None:
        return "Daly's optimum" if name == "checkpoint_interval_seconds" else "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def build_view(grid: GoodputGrid, plain: bool = False) -> Group:
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


def render_plain(grid: GoodputGrid, width: int = 150) -> str:
    """The table and the constants as plain text (no colour, no trailing spaces)."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False, highlight=False)
    console.print(build_view(grid, plain=True))
    return "".join(line.rstrip() + "\n" for line in console.file.getvalue().splitlines())


def show_goodput(grid: GoodputGrid) -> None:
    """The table on stdout: drawn by rich on a terminal, plain text when piped."""
    if sys.stdout.isatty():
        from rich.console import Console

        Console().print(build_view(grid))
    else:
        print(render_plain(grid), end="", flush=True)


def draw_goodput_plot(grid: GoodputGrid, path: Path) -> None:
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
