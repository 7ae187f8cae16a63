"""``diloco status``: a live view on a terminal, plain text when piped, JSON on request."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from diloco_cli.runtime.run_spec import RunSpec
from diloco_cli.views.format import ago, human_bytes, human_count, human_duration, short_duration
from diloco_cli.views.run_state import RunStatus, collect_status

STATE_STYLE = {"training": "green", "finished": "cyan", "waiting": "yellow", "stopped": "yellow", "failed": "bold red"}
FINAL_STATES = ("finished", "stopped")
LEARNER_COLUMNS = (
    ("learner", "left"),
    ("where", "left"),
    ("state", "left"),
    ("step", "right"),
    ("loss", "right"),
    ("st/s", "right"),
    ("base", "right"),
    ("seen", "right"),
    ("rst", "right"),
)
"""Steps per second, base version (+ staleness in versions), time since the last
heartbeat, restarts.  Region and host share a column ("where"; the host only when it is
not this machine), so the table fits an 80-column terminal."""


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def build_view(status: RunStatus, *, plain: bool = False) -> Group:
    table_box = box.SIMPLE if plain else box.SIMPLE_HEAVY
    run = Text()
    run.append(f"run {status.run}", style="bold")
    run.append(f"  {status.state}", style=STATE_STYLE.get(status.state, "bold"))
    run.append(
        f"  version {status.version}  tokens {human_count(status.tokens)}  held-out loss {_loss(status.heldout_loss)}"
        f"  elapsed {human_duration(status.elapsed_seconds)}"
    )
    learners = Table(box=table_box, title="learners (st/s: steps per second; base: version +staleness; seen: last heartbeat; rst: restarts)", title_justify="left", show_edge=False, pad_edge=False)
    for column, justify in LEARNER_COLUMNS:
        learners.add_column(column, justify=justify, no_wrap=True, overflow="ellipsis" if column in ("learner", "where") else "fold")
    for row in status.learners:
        where = row.region if row.host == "local" else f"{row.region}/{row.host}"
        base = "-" if row.base_version is None else f"{row.base_version} +{row.staleness}"
        learners.add_row(
            row.learner,
            where,
            Text(row.state, style=STATE_STYLE.get(row.state, "")),
            f"{row.step}/{row.total_steps}",
            _loss(row.loss),
            "-" if row.steps_per_second is None else f"{row.steps_per_second:.2f}",
            base,
            short_duration(row.last_seen_seconds),
            str(row.restarts),
        )
    syncer = status.syncer
    merge = syncer.last_merge
    merged = f"version {merge['version']} (fragment {merge['fragment']}, {len(merge['learners'])} learners) {ago(syncer.last_merge_seconds_ago)}" if merge else "none yet"
    grace = "-" if syncer.grace_seconds is None else f"{syncer.grace_seconds:.1f} s"
    quorum = "-" if syncer.quorum is None else f"K={syncer.quorum}" + (
        f" (now {syncer.effective_quorum})" if syncer.effective_quorum not in (None, syncer.quorum) else ""
    )
    lines = [
        f"syncer: {syncer.state}; last merge {merged}; {syncer.merges} merges, {syncer.merges_per_minute}/min; quorum {quorum}; grace {grace}; live {len(syncer.live_learners)}",
    ]
    if status.state not in FINAL_STATES:
        lines += [f"  fragment {fragment}: {reason}" for fragment, reason in sorted(syncer.reasons.items())]
    regions = Table(box=table_box, title="bytes per region", title_justify="left", show_edge=False)
    for column in ("region", "learners up", "learners down", "syncer up", "syncer down"):
        regions.add_column(column, justify="left" if column == "region" else "right")
    for region in status.regions:
        regions.add_row(region.region, human_bytes(region.learners_up), human_bytes(region.learners_down), human_bytes(region.syncer_up), human_bytes(region.syncer_down))
    return Group(run, learners, Text("\n".join(lines)), regions)


def render_plain(status: RunStatus, width: int = 140) -> str:
    console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False, highlight=False)
    console.print(build_view(status, plain=True))
    return console.file.getvalue()


def render_json(status: RunStatus) -> str:
    return json.dumps(status.to_json(), indent=2)


def show_status(spec: RunSpec, output: str, watch: bool, interval: float = 2.0) -> None:
    """Print once, or keep the view up until the run ends (Ctrl-C detaches)."""
    if output == "json":
        while True:
            status = collect_status(spec)
            print(render_json(status), flush=True)
            if not watch or status.state in FINAL_STATES:
                return
            time.sleep(interval)
    if not sys.stdout.isatty():
        while True:
            status = collect_status(spec)
            print(render_plain(status), flush=True)
            if not watch or status.state in FINAL_STATES:
                return
            time.sleep(interval)
    console = Console()
    if not watch:
        console.print(build_view(collect_status(spec)))
        return
    try:
        with Live(build_view(collect_status(spec)), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                status = collect_status(spec)
                live.update(build_view(status))
                if status.state in FINAL_STATES:
                    return
    except KeyboardInterrupt:
        console.print(f"detached; the run goes on (diloco down {spec.run} stops it)")


def watch_status(runs_dir: Path, run: str) -> None:
    from diloco_cli.launch.runs import load_run

    show_status(load_run(runs_dir, run).spec, "text", watch=True)
