"""``diloco report``: where a run's bytes went, as tables on a terminal, plain text when
piped, JSON, or one self-contained HTML page (:mod:`diloco_cli.views.report_html`)."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from diloco_cli.bandwidth.prices import PriceTable
from diloco_cli.bandwidth.report import TrafficReport, build_report
from diloco_cli.codec import RunSecret
from diloco_cli.store.run_spec import RunSpec
from diloco_cli.views.coordinators import run_state
from diloco_cli.views.format import human_bytes, human_count, human_duration
from diloco_cli.views.run_state import read_buckets

LINK_LEGEND = (
    "up: written into the bucket; down: read from it (listings estimated); "
    "MB/s: bytes over the time calls were in flight; "
    "share: of every byte the run moved; WAN: the bytes crossed a link between places"
)


def collect_report(
    spec: RunSpec, secret: RunSecret | None, prices: PriceTable, now: float | None = None
) -> TrafficReport:
    """The report of a run, finished or running, from its buckets."""
    now = time.time() if now is None else now
    read = read_buckets(spec, secret, now)
    syncers = [read.syncers.get(shard.index) for shard in spec.syncer_shards]
    present = {shard.name: syncer for shard, syncer in zip(spec.syncer_shards, syncers) if syncer is not None}
    state = run_state(syncers, now)
    return build_report(spec, read.heartbeats, present, prices, state, now, list(read.reducers.values()))


def _dollars(value: float) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def build_view(report: TrafficReport, plain: bool = False) -> Group:
    table_box = box.SIMPLE if plain else box.SIMPLE_HEAVY
    per_token = report.wan_bytes_per_token
    head = Text()
    head.append(f"run {report.run}", style="bold")
    head.append(
        f"  {report.state}  elapsed {human_duration(report.elapsed_seconds)}  tokens {human_count(report.tokens)}"
        f"  across links {human_bytes(report.wan_bytes)}"
        + (f" ({per_token:,.2f} B/token)" if per_token is not None else "")
        + f"  in regions {human_bytes(report.total_bytes - report.wan_bytes)}"
        f"  est. cost {_dollars(report.cost_dollars)}"
    )
    links = _table(
        "per link (bytes: objects and the requests' HTTP heads)",
        table_box,
        ("link", "WAN", "up", "down", "of it heads", "requests", "MB/s", "share", "cost"),
    )
    for link in report.links:
        links.add_row(
            link.name,
            "yes" if link.wan else "no",
            human_bytes(link.bytes_up),
            human_bytes(link.bytes_down),
            human_bytes(link.overhead_bytes),
            human_count(link.requests),
            _rate(link.megabytes_per_second),
            f"{link.share:.1%}",
            _dollars(link.cost_dollars),
        )
    learners = _table(
        "per learner",
        table_box,
        ("learner", "tokens", "deltas up", "checkpoints up", "other up", "down", "requests", "retried"),
    )
    for row in report.learners:
        learners.add_row(
            row.learner,
            human_count(row.tokens),
            human_bytes(row.delta_bytes_up),
            human_bytes(row.checkpoint_bytes_up),
            human_bytes(row.other_bytes_up),
            human_bytes(row.bytes_down),
            human_count(row.requests),
            str(row.retries) + (f" ({row.failures} failed)" if row.failures else ""),
        )
    syncers = _table("per syncer shard", table_box, ("syncer", "place", "merges", "up", "down", "requests", "home"))
    for row in report.syncers:
        syncers.add_row(
            row.name,
            row.place,
            human_count(row.merges),
            human_bytes(row.bytes_up),
            human_bytes(row.bytes_down),
            human_count(row.requests),
            human_bytes(row.home_bytes),
        )
    kinds = _table("per kind", table_box, ("kind", "requests", "up", "down", "across links", "cost"))
    for row in report.kinds:
        kinds.add_row(
            row.kind,
            human_count(row.requests),
            human_bytes(row.bytes_up),
            human_bytes(row.bytes_down),
            human_bytes(row.wan_bytes),
            _dollars(row.cost_dollars),
        )
    lines = []
    for c in report.compression:
        ratio = f"{c.ratio:.1f}x" if c.ratio else "-"
        lines.append(
            f"compression of {c.kind}s: {human_bytes(c.bytes)} written for {human_bytes(c.raw_fp32_bytes)} "
            f"of fp32 tensors ({ratio})"
        )
    dp = report.data_parallel
    if dp is not None:

        def versus(ratio: float | None) -> str:
            return f" ({ratio:,.0f}x what this run moved across links)" if ratio else ""

        lines += [
            f"synchronous data-parallel at equal tokens ({human_count(report.tokens)}): "
            f"{dp.steps:,.0f} steps of {human_count(dp.tokens_per_step)} tokens on {dp.workers} workers, "
            f"{human_count(dp.parameters)} parameters, bytes between regions:",
            f"  flat ring ({dp.region_crossings} of its {dp.workers} hops cross): {human_bytes(dp.wan_bytes)}"
            f"{versus(dp.wan_ratio)}",
            f"    {dp.formula}",
            f"  hierarchical (a ring of {dp.regions} region leaders): {human_bytes(dp.hierarchical_wan_bytes)}"
            f"{versus(dp.hierarchical_wan_ratio)}",
            f"    {dp.hierarchical_formula}",
        ]
    else:
        lines.append("data-parallel comparison: waiting for the syncer's first status")
    lines.append(f"cost: {report.cost_note}")
    shards = [syncers] if len(report.syncers) > 1 else []  # one syncer: its bytes are the links'
    return Group(head, links, Text(LINK_LEGEND, style="dim"), learners, *shards, kinds, Text("\n".join(lines)))


def _table(title: str, table_box: box.Box, columns: tuple[str, ...]) -> Table:
    table = Table(box=table_box, title=title, title_justify="left", show_edge=False)
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in ("link", "learner", "kind", "WAN", "syncer", "place") else "right",
            no_wrap=column != "link",
        )
    return table


def render_plain(report: TrafficReport, width: int = 140) -> str:
    """The report as plain text: tables fit ``width``, each line of prose stays one line."""
    console = Console(file=io.StringIO(), width=width, no_color=True, force_terminal=False, highlight=False)
    console.print(build_view(report, plain=True), soft_wrap=True)
    return console.file.getvalue()


def render_json(report: TrafficReport) -> str:
    document = report.model_dump(mode="json")
    document["cost_dollars"] = report.cost_dollars
    document["wan_bytes_per_token"] = report.wan_bytes_per_token
    if report.data_parallel is not None:
        document["data_parallel"]["wan_ratio"] = report.data_parallel.wan_ratio
        document["data_parallel"]["hierarchical_wan_ratio"] = report.data_parallel.hierarchical_wan_ratio
    for entry, compression in zip(document["compression"], report.compression):
        entry["ratio"] = compression.ratio
    return json.dumps(document, indent=2)


def show_report(report: TrafficReport, output: str, html: Path | None) -> None:
    """Print the report (and write the HTML page when asked)."""
    if html is not None:
        from diloco_cli.views.report_html import render_html

        html.write_text(render_html(report))
    if output == "json":
        print(render_json(report))
    elif sys.stdout.isatty():
        Console().print(build_view(report))
    else:
        print(render_plain(report), end="")
    if html is not None and output != "json":
        print(f"wrote {html}", file=sys.stderr)
