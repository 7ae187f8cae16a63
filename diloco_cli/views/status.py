"""``diloco status``: a live view on a terminal, plain text when piped, JSON on request."""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from diloco_cli.codec import RunSecret
from diloco_cli.store.run_spec import RunSpec
from diloco_cli.views.coordinators import ReducerSummary, SyncerSummary
from diloco_cli.views.format import ago, human_bytes, human_count, human_duration, plural
from diloco_cli.views.run_state import RunStatus, collect_status

if TYPE_CHECKING:
    from rich.console import Group

# rich is imported where the view is drawn: `status --output json` draws nothing

STATE_STYLE = {
    "syncer down": "bold red",
    "syncer not reporting": "bold red",
    "training": "green",
    "finished": "cyan",
    "drained": "cyan",
    "draining": "yellow",
    "waiting": "yellow",
    "stopped": "yellow",
    "failed": "bold red",
}
FINAL_STATES = ("finished", "stopped")
LEARNER_COLUMNS = (
    ("learner", "left"),
    ("where", "left"),
    ("state", "left"),
    ("step", "right"),
    ("loss", "right"),
    ("st/s", "right"),
    ("base\n+behind", "right"),
    ("seen", "right"),
    ("rst", "right"),
)
"""Steps per second, base version (+ versions behind the newest), time since the last
heartbeat, restarts.  Region and host share a column ("where"; the host only when it is
not this machine), so the table fits an 80-column terminal."""
STORAGE_LEGEND = (
    "storage per region: bytes each way (learners' checkpoints apart); retried: calls tried again; "
    "refused: objects damaged or forged"
)
LEGEND = (
    "st/s: steps per second; base +behind: the global version a learner holds, and how many versions "
    "it is behind; seen: since its last heartbeat; rst: restarts"
)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def heldout(status: RunStatus) -> str:
    """``2.710 (version 6)``: the loss with the version it was measured at, which lags."""
    if status.heldout_loss is None:
        return "-"
    of = " of syncer-0" if status.syncer_shards else ""  # shard 0 evaluates, at its own versions
    return f"{status.heldout_loss:.3f} (version {status.heldout_version}{of})"


def build_view(status: RunStatus, *, plain: bool = False, probe: list[dict] | None = None) -> Group:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table_box = box.SIMPLE if plain else box.SIMPLE_HEAVY
    run = Text()
    run.append(f"run {status.run}", style="bold")
    run.append(f"  {status.state}", style=STATE_STYLE.get(status.state, "bold"))
    run.append(
        f"  version {status.version}  tokens {human_count(status.tokens)}  held-out loss {heldout(status)}"
        f"  elapsed {human_duration(status.elapsed_seconds)}"
    )
    learners = Table(box=table_box, show_edge=False, pad_edge=False, collapse_padding=True)  # 80 columns hold it
    for column, justify in LEARNER_COLUMNS:
        learners.add_column(
            column, justify=justify, no_wrap=True, overflow="ellipsis" if column in ("learner", "where") else "fold"
        )
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
            human_duration(row.last_seen_seconds, compact=True),
            str(row.restarts),
        )
    legend = Text(LEGEND, style="dim")  # its own line, wrapped to the terminal, not to the table
    syncer = status.syncer
    merge = syncer.last_merge
    merged = (
        f"version {merge['version']} (fragment {merge['fragment']}, {plural(len(merge['learners']), 'learner')}) "
        f"{ago(syncer.last_merge_seconds_ago)}"
        if merge
        else "none yet"
    )
    grace = "-" if syncer.grace_seconds is None else f"{syncer.grace_seconds:.1f} s"
    quorum = (
        "-"
        if syncer.quorum is None
        else f"K={syncer.quorum}"
        + (
            f", lowered to {syncer.effective_quorum} while only {len(syncer.live_learners)} live"
            if syncer.effective_quorum not in (None, syncer.quorum) and status.state not in FINAL_STATES
            else ""
        )
    )
    state = (
        f"{syncer.state} (last report {ago(syncer.last_report_seconds)})"
        if syncer.state in ("not reporting", "down")
        else syncer.state
    )
    who = "syncer" if not status.syncer_shards else f"{len(status.syncer_shards)} syncer shards"
    rate = "" if status.state in FINAL_STATES else f", {syncer.merges_per_minute} in the last minute"
    lines = [
        f"{who}: {state}; last merge {merged}; {plural(syncer.merges, 'merge')}{rate}; "
        f"quorum {quorum}; grace {grace}; live {len(syncer.live_learners)}",
    ]
    lines += [shard_line(shard) for shard in status.syncer_shards]
    if syncer.repairs or syncer.leftovers_removed:
        lines.append(
            f"  rewrote {plural(syncer.repairs, 'damaged published object')}; "
            f"removed {plural(syncer.leftovers_removed, 'leftover')}"
        )
    if status.state not in FINAL_STATES:
        lines += [f"  fragment {fragment}: {reason}" for fragment, reason in sorted(syncer.reasons.items())]
    lines += [reducer_line(reducer) for reducer in status.reducers]
    regions = Table(box=table_box, show_edge=False, collapse_padding=True, pad_edge=False)  # 80 columns hold it
    for column in (
        "region",
        "learners\nup",
        "learners\ndown",
        "checkpoints",
        "syncer\nup",
        "syncer\ndown",
        "retried",
        "refused",
    ):
        regions.add_column(column, justify="left" if column == "region" else "right", no_wrap=True)
    refusal_lines = []
    for region in status.regions:
        refused = sum(region.refusals.values())
        failed = f" ({region.failures} failed)" if region.failures else ""
        regions.add_row(
            region.region,
            human_bytes(region.learners_up),
            human_bytes(region.learners_down),
            human_bytes(region.checkpoints_up),
            human_bytes(region.syncer_up),
            human_bytes(region.syncer_down),
            f"{region.retries}{failed}",
            str(refused),
        )
        if region.latest_refusal is not None:
            note = region.latest_refusal
            kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(region.refusals.items()))
            refusal_lines.append(
                f"refused in {region.region}: {kinds}; latest {note['kind']} {note['key']} "
                f"{ago(time.time() - note['time'])}: {note['reason']}"
            )
    parts = [run]
    if status.problems:
        parts.append(Text("\n".join(f"! {problem}" for problem in status.problems), style="bold red"))
    parts += [learners, legend, Text("\n".join(lines)), regions, Text(STORAGE_LEGEND, style="dim")]
    if status.bandwidth:
        parts.append(Text(status.bandwidth))
    if status.chaos:
        parts.append(Text(status.chaos))
    if status.scaling:
        parts.append(Text(status.scaling))
    if refusal_lines:
        parts.append(Text("\n".join(refusal_lines), style="yellow"))
    if probe is not None:
        hosts = Table(box=table_box, title="processes (probed)", title_justify="left", show_edge=False)
        jobs = any(row.get("job") for row in probe)  # Slurm jobs: their id and the scheduler's word
        for column in ("process", "host", "ssh", "supervisor", "restarts", *(("slurm job",) if jobs else ())):
            hosts.add_column(column, overflow="fold")
        for row in probe:
            job = (f"{row['job']} {row.get('job_state') or ''}".strip(),) if jobs and row.get("job") else ("",) * jobs
            hosts.add_row(row["process"], row["host"], row["ssh"], row["supervisor"], str(row["restarts"]), *job)
        parts.append(hosts)
    return Group(*parts)


def render_plain(status: RunStatus, width: int = 140, probe: list[dict] | None = None) -> str:
    """The view as plain text: tables fit ``width``, and each line of prose stays one line
    (soft wrap: what reads the pipe wraps it, never mid-phrase)."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False, highlight=False)
    console.print(build_view(status, plain=True, probe=probe), soft_wrap=True)
    return console.file.getvalue()


def render_json(status: RunStatus, probe: list[dict] | None = None) -> str:
    document = status.to_json()
    if probe is not None:
        document["probe"] = probe
    return json.dumps(document, indent=2)


def show_status(
    spec: RunSpec,
    output: str,
    watch: bool,
    interval: float = 2.0,
    secret: RunSecret | None = None,
    processes: Callable[[], list[dict]] | None = None,
    probed: bool = False,
) -> None:
    """Print once, or keep the view up until the run ends (Ctrl-C detaches).
    ``processes`` asks the run's supervisors (at every refresh); with ``probed`` their
    rows are shown too."""

    def gather() -> tuple[RunStatus, list[dict] | None]:
        rows = processes() if processes else None
        return collect_status(spec, secret, rows), rows if probed else None

    if output == "json" or not sys.stdout.isatty():
        render = render_json if output == "json" else render_plain
        while True:
            status, rows = gather()
            print(render(status, probe=rows), flush=True)
            if not watch or status.state in FINAL_STATES:
                return
            time.sleep(interval)
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not watch:
        status, rows = gather()
        console.print(build_view(status, probe=rows))
        return
    try:
        status, rows = gather()
        with Live(build_view(status, probe=rows), console=console, refresh_per_second=4, screen=False) as live:
            while status.state not in FINAL_STATES:
                time.sleep(interval)
                status, rows = gather()
                live.update(build_view(status, probe=rows))
    except KeyboardInterrupt:
        console.print(f"detached; the run goes on (diloco down {spec.run} stops it)")


def shard_line(shard: SyncerSummary) -> str:
    """One line per syncer shard: its state, its version, its merges, when it last merged."""
    state = (
        f"{shard.state} (last report {ago(shard.last_report_seconds)})"
        if shard.state in ("not reporting", "down")
        else shard.state
    )
    merge = shard.last_merge
    last = f"; last merge {ago(shard.last_merge_seconds_ago)} (fragment {merge['fragment']})" if merge else ""
    return f"  {shard.name}: {state}; version {shard.version}; {plural(shard.merges, 'merge')}{last}"


def reducer_line(reducer: ReducerSummary) -> str:
    """One line per region's reducer (and syncer shard): its state, its copy's version,
    what it forwarded, and what waits there."""
    name = reducer.region if reducer.shard is None else f"{reducer.region} (shard {reducer.shard})"
    if reducer.state == "starting":
        return f"reducer {name}: starting"
    waiting = sorted({learner for learners in reducer.waiting.values() for learner in learners})
    in_flight = sorted({learner for learners in reducer.in_flight.values() for learner in learners})
    held = (f"; waiting {', '.join(waiting)}" if waiting else "") + (
        f"; in flight {', '.join(in_flight)}" if in_flight else ""
    )
    discarded = f" ({reducer.voided} sent again)" if reducer.voided else ""
    return (
        f"reducer {name}: {reducer.state}; version {reducer.version}; "
        f"{plural(reducer.aggregates, 'aggregate')} of {plural(reducer.sends, 'send')}{discarded}{held}"
    )
