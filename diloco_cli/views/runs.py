"""``diloco runs``: the runs started from this directory, as a table or JSON."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from diloco_cli.views.format import plural

if TYPE_CHECKING:
    from diloco_cli.launch.runs import RunSummary
    from diloco_cli.store.run_spec import RunSpec


def no_runs(runs_dir: Path) -> str:
    """What ``runs`` and ``status`` say where no run was started."""
    return f"no runs in {runs_dir.resolve()}; start one with `diloco up`"


def render_runs(summaries: list[RunSummary], runs_dir: Path, output: str) -> str:
    if output == "json":
        return json.dumps([asdict(summary) for summary in summaries], indent=2)
    if not summaries:
        return no_runs(runs_dir)
    width = max(len("RUN"), *(len(summary.name) for summary in summaries))
    lines = [f"{'RUN':<{width}}  {'CREATED':<19}  {'STATE':<9} {'LEARNERS':>8}  WHERE"]
    for summary in summaries:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.created))
        where = ", ".join(summary.regions) + (
            "" if summary.hosts == ("local",) else f" (hosts: {', '.join(summary.hosts)})"
        )
        lines.append(f"{summary.name:<{width}}  {created:<19}  {summary.state:<9} {summary.learners:>8}  {where}")
    return "\n".join(lines)


def render_stopped(run: str, outcome: dict[str, tuple[str, str]], state: str) -> str:
    """What ``down`` did to each process, and the run's state after it, in the words of
    ``diloco runs`` (a finished run stays finished: there was nothing to stop)."""
    lines = [f"  {process:<16} {host:<12} {how}" for process, (host, how) in outcome.items()]
    if any(how != "not running" for _, how in outcome.values()):
        lines.append(f"run {run} is {state} now")
    else:
        lines.append(f"run {run} is {state}: nothing of it was running")
    return "\n".join(lines)


def render_started(spec: RunSpec) -> str:
    """What ``up`` says once a run is started: its name and the commands to follow it."""
    reducers = f", {plural(len(spec.reducers), 'reducer')}" if spec.reducers else ""
    shards = len(spec.syncer_shards)
    syncer = "syncer" if shards == 1 else f"{shards} syncer shards"
    return "\n".join(
        [
            f"started run {spec.run}: {syncer}{reducers} and {plural(len(spec.learners), 'learner')}",
            f"  watch it:   diloco status {spec.run} --watch",
            f"  its logs:   diloco logs {spec.run} [LEARNER] --follow",
            f"  stop it:    diloco down {spec.run}",
        ]
    )
