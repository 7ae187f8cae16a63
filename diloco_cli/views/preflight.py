"""The preflight table: one row per SSH host, its checks and its first problem."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # a view renders what launch found; it does not call launch
    from diloco_cli.launch.preflight import HostReport

CHECKS = ("ssh", "python", "torch", "disk", "clock", "gpus", "bucket")


def render_preflight(reports: list[HostReport], width: int = 120) -> str:
    checks = (*CHECKS, "slurm") if any("slurm" in report.checks for report in reports) else CHECKS
    table = Table(title="preflight", title_justify="left", show_edge=False)
    table.add_column("host")
    table.add_column("regions")
    for check in checks:
        table.add_column(check)
    table.add_column("first problem", overflow="fold")
    for report in reports:
        table.add_row(
            report.host.name,
            ", ".join(report.regions) or "(syncer)",
            *(report.checks.get(check, "-") for check in checks),
            report.problem or "",
        )
    console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False)
    console.print(table)
    problems = [f"  {report.host.name}: {report.problem}" for report in reports if report.problem]
    if problems:  # again in full, one per line, for reading and copying
        console.print("\n".join(["problems:", *problems]), soft_wrap=True)
    return console.file.getvalue()
