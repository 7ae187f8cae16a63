"""``diloco runs``: the runs started from this directory."""

from __future__ import annotations

import json
import time
from pathlib import Path

from diloco_cli.launch.processes import is_running
from diloco_cli.launch.runs import list_runs


def runs_table(runs_dir: Path) -> list[dict]:
    rows = []
    for record in list_runs(runs_dir):
        alive = sum(1 for process in record.processes if is_running(process["pid"]))
        rows.append(
            {
                "run": record.name,
                "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.spec.created)),
                "learners": len(record.spec.learners),
                "regions": [region.name for region in record.spec.regions],
                "processes_running": alive,
                "state": "running" if alive else "stopped",
            }
        )
    return rows


def render_runs(runs_dir: Path, output: str) -> str:
    rows = runs_table(runs_dir)
    if output == "json":
        return json.dumps(rows, indent=2)
    if not rows:
        return f"no runs in {runs_dir}; start one with `diloco up`"
    header = f"{'RUN':<40} {'CREATED':<20} {'LEARNERS':>8}  {'STATE':<8} REGIONS"
    lines = [header]
    for row in rows:
        lines.append(f"{row['run']:<40} {row['created']:<20} {row['learners']:>8}  {row['state']:<8} {', '.join(row['regions'])}")
    return "\n".join(lines)
