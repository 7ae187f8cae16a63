"""``diloco runs``: the runs started from this directory, as a table or JSON."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco_cli.launch.runs import RunSummary


def render_runs(summaries: list[RunSummary], runs_dir: Path, output: str) -> str:
    if output == "json":
        return json.dumps([asdict(summary) for summary in summaries], indent=2)
    if not summaries:
        return f"no runs in {runs_dir}; start one with `diloco up`"
    width = max(len("RUN"), *(len(summary.name) for summary in summaries))
    lines = [f"{'RUN':<{width}}  {'CREATED':<19}  {'STATE':<9} {'LEARNERS':>8}  WHERE"]
    for summary in summaries:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.created))
        where = ", ".join(summary.regions) + (
            "" if summary.hosts == ("local",) else f" (hosts: {', '.join(summary.hosts)})"
        )
        lines.append(f"{summary.name:<{width}}  {created:<19}  {summary.state:<9} {summary.learners:>8}  {where}")
    return "\n".join(lines)
