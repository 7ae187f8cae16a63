"""``diloco report --html``: one self-contained page (opened in a real headless browser:
tests/integration/test_report_browser.py)."""

import re
import sys

import pytest

from diloco_cli.views.report_html import PLOTS_MISSING, render_html
from tests.support.traffic_report import PLOTS, TABLES, realistic


def test_the_page_is_self_contained_and_escapes_every_string():
    html = render_html(realistic(run="a<b>&c"))

    assert "<script" not in html and "<link" not in html and "@import" not in html and " src=" not in html
    assert all(target.startswith("#") for target in re.findall(r"url\(([^)]*)\)", html))
    assert all(target.startswith("#") for target in re.findall(r'href="([^"]*)"', html))
    assert "<?xml" not in html and "<!DOCTYPE svg" not in html
    assert "a&lt;b&gt;&amp;c" in html and "a<b>" not in html
    assert "seconds since start" in html  # a 5-minute run
    assert all(f'id="{name}"' in html for name in TABLES + PLOTS)


def test_without_matplotlib_the_page_says_what_the_plots_need(monkeypatch):
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")] + [
        "matplotlib"
    ]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib... raises ImportError

    html = render_html(realistic())

    assert PLOTS_MISSING.replace('"', "&quot;") in html
    assert "<svg" not in html and not any(f'id="{name}"' in html for name in PLOTS)
    assert all(f'id="{name}"' in html for name in TABLES)


def test_a_run_that_has_reported_nothing_yet_still_renders():
    pytest.importorskip("matplotlib")
    html = render_html(
        realistic(
            links=[],
            learners=[],
            kinds=[],
            compression=[],
            data_parallel=None,
            evaluations=[],
            tokens=0,
            wan_bytes=0,
            total_bytes=0,
            elapsed_seconds=7200.0,
        )
    )

    assert "the syncer has not reported the model&#x27;s size" in html
    assert all(f'id="{name}"' in html for name in TABLES + PLOTS)
    assert "minutes since start" in html and "no evaluation yet" in html


def test_the_rates_plot_stacks_each_links_kinds_beside_data_parallels_rates():
    """Per WAN link its bytes per second by kind over the run, summing to the table's
    bytes; a bar for all links; data-parallel's two rates for the same tokens in the same
    time (its bytes over the elapsed seconds)."""
    pytest.importorskip("matplotlib")
    from diloco_cli.views.report_html import data_parallel_rates, wan_rates

    report = realistic()
    bars = dict(wan_rates(report))
    assert list(bars) == ["syncer-host -> eu-west", "syncer-host -> us-east", "all links"]
    one = bars["syncer-host -> eu-west"]
    assert sum(one.values()) == pytest.approx((60_000_000 + 70_000_000) / 330.0)
    assert one["payload"] == pytest.approx(30_000_000 / 330.0)
    assert sum(bars["all links"].values()) == pytest.approx(report.wan_bytes / 330.0)
    (flat, flat_rate), (hierarchical, hierarchical_rate) = data_parallel_rates(report)
    assert flat_rate == pytest.approx(146.5 * 2 * 372_000_000 / 330.0) and "flat ring" in flat
    assert hierarchical_rate == pytest.approx(146.5 * 2 * 248_000_000 / 330.0) and "hierarchical" in hierarchical
    html = render_html(report)
    rates = html[html.index('id="plot-rates"') : html.index("</figure>", html.index('id="plot-rates"'))]
    assert "data-parallel, flat ring" in rates and "heartbeat" in rates and "all links" in rates
    local_only = realistic(links=[link for link in report.links if not link.wan])
    assert wan_rates(local_only) == [] and "no bytes crossed a link yet" in render_html(local_only)


def test_the_rates_plots_legend_covers_no_bar():
    """Issue 32, 8: the legend of "bytes per second across links, by kind" sat on the
    bars; it goes below the axes."""
    pytest.importorskip("matplotlib")
    from diloco_cli.views.report_html import rates_figure

    fig = rates_figure(realistic())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (axes,) = fig.axes
    legends = fig.legends + ([axes.get_legend()] if axes.get_legend() else [])
    assert len(legends) == 1 and {text.get_text() for text in legends[0].get_texts()} >= {"payload", "heartbeat"}
    legend = legends[0].get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in axes.patches]
    assert bars and not any(legend.overlaps(bar) for bar in bars)
    assert not legend.overlaps(axes.get_window_extent(renderer))
