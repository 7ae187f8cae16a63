"""``diloco report --html``: where a run's bytes went, as one self-contained HTML page.

Everything is inline (CSS, plots as SVG); the page loads nothing, so it can be mailed,
archived or opened offline.  Plots need matplotlib (``pip install "diloco-cli[plots]"``),
imported only when a page is rendered; without it the page says so in their place.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Sequence
from html import escape
from typing import TYPE_CHECKING

from diloco_cli.bandwidth.report import TrafficReport
from diloco_cli.store.metering import KINDS
from diloco_cli.views.format import human_bytes, human_count, human_duration

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTS_MISSING = 'plots need matplotlib: pip install "diloco-cli[plots]"'

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #1b1f24; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: .3em; } h2 { font-size: 1.15em; margin-top: 1.8em; }
.facts { display: flex; flex-wrap: wrap; gap: .6em 2.2em; margin: 0; padding: .8em 1em; background: #f3f5f7;
         border-radius: 6px; }
.facts div { display: flex; flex-direction: column; } .facts dt { font-size: .8em; color: #57606a; }
.facts dd { margin: 0; font-weight: 600; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; margin: .4em 0; font-variant-numeric: tabular-nums; }
th, td { padding: .25em .8em; border-bottom: 1px solid #d8dee4; text-align: right; white-space: nowrap; }
th { background: #f3f5f7; font-weight: 600; } th:first-child, td:first-child { text-align: left; }
td.empty { text-align: left; color: #57606a; font-style: italic; }
.note { color: #57606a; font-size: .9em; } code { font-size: .95em; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; } figure { margin: 0; }
figure svg { width: 34em; max-width: 100%; height: auto; }
"""


def render_html(report: TrafficReport) -> str:
    """The whole page, ready to write to a ``.html`` file."""
    body = [
        f"<h1>diloco report: {escape(report.run)}</h1>",
        _facts(report),
        "<h2>Plots</h2>",
        _plots(report),
        *_tables(report),
        "<h2>Cost</h2>",
        f'<p id="cost-note" class="note">{escape(report.cost_note)}</p>',
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        # Loads nothing, runs nothing: a browser refuses any request the page would make.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\n"
        f"<title>diloco report: {escape(report.run)}</title>\n<style>{STYLE}</style>\n</head>\n"
        "<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


# ---------------------------------------------------------------------------- text


def _dollars(amount: float) -> str:
    return f"${amount:,.2f}" if amount >= 0.01 or amount == 0 else f"${amount:.4f}"


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f}x" if value < 100 else f"{value:,.0f}x"


def _per_token(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.2f} B" if value < 1000 else human_bytes(value)


def _facts(report: TrafficReport) -> str:
    facts = [
        ("state", report.state),
        ("elapsed", human_duration(report.elapsed_seconds)),
        ("tokens", human_count(report.tokens)),
        ("across links (WAN)", human_bytes(report.wan_bytes)),
        ("WAN bytes per token", _per_token(report.wan_bytes_per_token)),
        ("all bytes", human_bytes(report.total_bytes)),
        ("learners reporting", str(report.learners_reporting)),
        ("total cost", _dollars(report.cost_dollars)),
    ]
    items = "".join(f"<div><dt>{escape(name)}</dt><dd>{escape(value)}</dd></div>" for name, value in facts)
    return f'<dl id="facts" class="facts">{items}</dl>'


def _table(table_id: str, title: str, header: Sequence[str], rows: Iterable[Sequence[object]], empty: str) -> str:
    head = "".join(f"<th>{escape(str(cell))}</th>" for cell in header)
    head = f"<thead><tr>{head}</tr></thead>\n" if any(header) else ""
    lines = ["<tr>" + "".join(f"<td>{escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows]
    if not lines:
        lines = [f'<tr><td class="empty" colspan="{len(header)}">{escape(empty)}</td></tr>']
    return (
        f'<h2>{escape(title)}</h2>\n<table id="{table_id}">\n{head}<tbody>\n'
        + "\n".join(lines)
        + "\n</tbody>\n</table>"
    )


def _tables(report: TrafficReport) -> list[str]:
    links = [
        (
            link.name,
            "WAN" if link.wan else "in region",
            human_bytes(link.bytes_up),
            human_bytes(link.bytes_down),
            human_bytes(link.overhead_bytes),
            f"{link.requests:,}",
            "-" if link.megabytes_per_second is None else f"{link.megabytes_per_second:,.1f} MB/s",
            f"{link.share:.1%}",
            _dollars(link.cost_dollars),
        )
        for link in report.links
    ]
    learners = [
        (
            row.learner,
            row.region,
            human_count(row.tokens),
            human_bytes(row.delta_bytes_up),
            human_bytes(row.checkpoint_bytes_up),
            human_bytes(row.other_bytes_up),
            human_bytes(row.bytes_down),
            f"{row.requests:,}",
            row.retries,
            row.failures,
        )
        for row in report.learners
    ]
    syncers = [
        (
            row.name,
            row.place,
            f"{row.merges:,}",
            human_bytes(row.bytes_up),
            human_bytes(row.bytes_down),
            f"{row.requests:,}",
            human_bytes(row.home_bytes),
        )
        for row in report.syncers
    ]
    kinds = [
        (
            k.kind,
            f"{k.requests:,}",
            human_bytes(k.bytes_up),
            human_bytes(k.bytes_down),
            human_bytes(k.wan_bytes),
            _dollars(k.cost_dollars),
        )
        for k in report.kinds
    ]
    compression = [
        (c.kind, human_bytes(c.bytes), human_bytes(c.raw_fp32_bytes), _ratio(c.ratio)) for c in report.compression
    ]
    return [
        _table(
            "table-links",
            "Links (bytes: objects and the requests' HTTP heads)",
            ("link", "", "up", "down", "of it heads", "requests", "rate", "share", "cost"),
            links,
            "no traffic reported yet",
        ),
        _table(
            "table-learners",
            "Learners",
            (
                "learner",
                "region",
                "tokens",
                "deltas up",
                "checkpoints up",
                "other up",
                "down",
                "requests",
                "retries",
                "failures",
            ),
            learners,
            "no learner has reported yet",
        ),
        *(
            [
                _table(
                    "table-syncers",
                    "Syncer shards",
                    ("syncer", "place", "merges", "up", "down", "requests", "home"),
                    syncers,
                    "no syncer shard has reported yet",
                )
            ]
            if len(report.syncers) > 1
            else []
        ),
        _table(
            "table-kinds",
            "By kind",
            ("kind", "requests", "up", "down", "across links", "cost"),
            kinds,
            "no traffic reported yet",
        ),
        _table(
            "table-compression",
            "Compression",
            ("kind", "written", "fp32 size", "smaller by"),
            compression,
            "no tensors written yet",
        ),
        _data_parallel(report),
    ]


def _data_parallel(report: TrafficReport) -> str:
    dp = report.data_parallel
    title = "Against synchronous data-parallel, at equal tokens"
    if dp is None:
        return _table(
            "table-data-parallel", title, ("", ""), [], "not yet: the syncer has not reported the model's size"
        )
    rows = [
        ("parameters", human_count(dp.parameters)),
        ("workers (M)", dp.workers),
        ("tokens per step", human_count(dp.tokens_per_step)),
        ("steps for this run's tokens", f"{dp.steps:,.1f}"),
        ("bytes per worker per step", human_bytes(dp.bytes_per_worker_step)),
        ("this run moved across links", human_bytes(dp.diloco_wan_bytes)),
        (f"flat ring between regions ({dp.region_crossings} of {dp.workers} ring hops)", human_bytes(dp.wan_bytes)),
        ("flat ring / this run", _ratio(dp.wan_ratio)),
        (f"hierarchical between regions ({dp.regions} leaders)", human_bytes(dp.hierarchical_wan_bytes)),
        ("hierarchical / this run", _ratio(dp.hierarchical_wan_ratio)),
    ]
    return (
        _table("table-data-parallel", title, ("", ""), rows, "")
        + f'\n<p class="note">flat ring: <code>{escape(dp.formula)}</code>; hierarchical: '
        f"<code>{escape(dp.hierarchical_formula)}</code>; at equal tokens, not equal loss "
        "(<code>bench.wan</code> measures equal loss)</p>"
    )


# ---------------------------------------------------------------------------- plots


LINE_STYLES = ("-", "--", ":", "-.")


def _plots(report: TrafficReport) -> str:
    """The four plots as inline SVG, or the line saying what they need."""
    try:
        from matplotlib import rc_context
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return f'<p id="plots-missing" class="note">{escape(PLOTS_MISSING)}</p>'

    def svg(fig: Figure, plot_id: str, title: str) -> str:
        buffer = io.StringIO()
        with rc_context({"svg.fonttype": "none"}):  # text as text: no glyph outlines, no fonts to load
            fig.savefig(buffer, format="svg", metadata={"Date": None})
        text = buffer.getvalue()
        text = text[text.index("<svg") :]  # no XML prolog, no DOCTYPE
        text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.DOTALL)
        return f'<figure id="{plot_id}" aria-label="{escape(title)}">{text}</figure>'

    def figure(
        plot_id: str,
        title: str,
        xlabel: str,
        ylabel: str,
        lines: list[tuple[str, list[float], list[float]]],
        empty: str,
        counts: bool = False,
    ) -> str:
        fig = Figure(figsize=(6.4, 3.6), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.add_subplot()
        axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
        axes.grid(True, alpha=0.3)
        if counts:
            axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: human_count(value)))
        for index, (label, xs, ys) in enumerate(lines):  # series that coincide stay visible: each a dash of its own
            style = LINE_STYLES[index % len(LINE_STYLES)]
            axes.plot(
                xs, ys, style, marker="." if len(xs) < 40 else None, label=label, linewidth=max(0.8, 2.6 - 0.3 * index)
            )
        if not any(xs for _, xs, _ in lines):
            axes.text(0.5, 0.5, empty, transform=axes.transAxes, ha="center", va="center", color="#57606a")
        elif len(lines) > 1:
            axes.legend(fontsize="small")
        return svg(fig, plot_id, title)

    start = report.started_at
    unit, per = _time_unit(
        max([report.elapsed_seconds] + [when - start for link in report.links for when, _, _ in link.history])
    )
    traffic = [
        (
            link.name,
            [(when - start) / per for when, _, _ in link.history],
            [(up + down) / 1e6 for _, up, down in link.history],
        )
        for link in report.links
    ]
    evaluations = sorted(report.evaluations, key=lambda e: (e.tokens, e.time))
    by_tokens = [("held-out", [e.tokens for e in evaluations], [e.loss for e in evaluations])]
    by_time = [("held-out", [(e.time - start) / per for e in evaluations], [e.loss for e in evaluations])]
    since = f"{unit} since start"
    figures = [
        figure("plot-bytes", "Bytes moved per link", since, "cumulative MB", traffic, "no traffic history yet"),
        svg(rates_figure(report), "plot-rates", RATES_TITLE),
        figure(
            "plot-loss-tokens",
            "Held-out loss against tokens",
            "tokens",
            "held-out loss",
            by_tokens,
            "no evaluation yet",
            counts=True,
        ),
        figure("plot-loss-time", "Held-out loss against time", since, "held-out loss", by_time, "no evaluation yet"),
    ]
    return '<div class="plots">' + "\n".join(figures) + "</div>"


RATES_TITLE = "Bytes per second across links, by kind"


def rates_figure(report: TrafficReport) -> Figure:
    """Bytes per second across each WAN link (and all of them), stacked by kind, with
    what data-parallel would need for the same tokens in the same time; the legend below
    the axes, where it covers no bar."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    bars = wan_rates(report)
    fig = Figure(figsize=(6.4, 3.6 if not bars else 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.add_subplot()
    axes.set(title=RATES_TITLE, xlabel="bytes per second over the run (log scale)")
    if not bars:
        axes.text(0.5, 0.5, "no bytes crossed a link yet", transform=axes.transAxes, ha="center", va="center")
        axes.set_yticks([])
        return fig
    axes.set_xscale("log")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: human_bytes(value) + "/s"))
    kinds = [kind for kind in KINDS if any(kind in by_kind for _, by_kind in bars)]
    smallest = min(rate for _, by_kind in bars for rate in by_kind.values())
    colors = colormaps["tab20"]
    for index, kind in enumerate(kinds):
        lefts, widths = [], []
        for _, by_kind in bars:
            before = sum(by_kind.get(k, 0.0) for k in kinds[:index])
            lefts.append(max(before, smallest / 10))  # a log axis has no 0: the first kind starts below all
            widths.append(before + by_kind.get(kind, 0.0) - lefts[-1] if kind in by_kind else 0.0)
        axes.barh(range(len(bars)), widths, left=lefts, label=kind, color=colors(index % 20))
    axes.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize="small")
    axes.invert_yaxis()
    for (label, rate), style in zip(data_parallel_rates(report), ("--", ":")):
        axes.axvline(rate, color="#cf222e", linestyle=style, label=label)
    axes.grid(True, axis="x", alpha=0.3)
    fig.legend(fontsize="x-small", loc="outside lower center", ncols=3)
    return fig


def wan_rates(report: TrafficReport) -> list[tuple[str, dict[str, float]]]:
    """Each WAN link's bytes per second over the run by kind, and, with several links,
    all of them together (what data-parallel's rates compare with)."""
    seconds = max(report.elapsed_seconds, 1e-9)
    links = [link for link in report.links if link.wan and link.kinds]
    bars = [(link.name, {kind: count / seconds for kind, count in link.kinds.items()}) for link in links]
    if len(bars) > 1:
        total: dict[str, float] = {}
        for _, by_kind in bars:
            for kind, rate in by_kind.items():
                total[kind] = total.get(kind, 0.0) + rate
        bars.append(("all links", total))
    return bars


def data_parallel_rates(report: TrafficReport) -> list[tuple[str, float]]:
    """What synchronous data-parallel would move between regions per second to train the
    run's tokens in the run's time: a flat ring and a hierarchical all-reduce."""
    dp, seconds = report.data_parallel, max(report.elapsed_seconds, 1e-9)
    if dp is None:
        return []
    return [
        (f"data-parallel, flat ring ({_ratio(dp.wan_ratio)})", dp.wan_bytes / seconds),
        (f"data-parallel, hierarchical ({_ratio(dp.hierarchical_wan_ratio)})", dp.hierarchical_wan_bytes / seconds),
    ]


def _time_unit(span: float) -> tuple[str, float]:
    """Seconds for a short run, minutes or hours for a longer one: ticks people can read."""
    if span < 600:
        return "seconds", 1.0
    return ("minutes", 60.0) if span < 10 * 3600 else ("hours", 3600.0)
