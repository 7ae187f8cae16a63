"""``diloco report --html``: one self-contained page, opened in a real headless browser."""

import re
import sys

import pytest

from diloco_cli.bandwidth.report import (
    Compression,
    DataParallelComparison,
    KindRow,
    LearnerTraffic,
    LinkRow,
    TrafficReport,
)
from diloco_cli.store.documents import Evaluation
from diloco_cli.views.report_html import PLOTS_MISSING, render_html
from tests.support.browser import open_page

TABLES = ("table-links", "table-learners", "table-kinds", "table-compression", "table-data-parallel")
PLOTS = ("plot-bytes", "plot-loss-tokens", "plot-loss-time")
START = 1_790_000_000.0
NASTY = '<script>alert("x")</script> & <b>'


def history(rate_up: int, rate_down: int, samples: int = 12) -> list[tuple[float, int, int]]:
    return [(START + 30 * i, rate_up * i, rate_down * i) for i in range(samples)]


def link(source: str, bucket: str, up: int, down: int, share: float, cost: float) -> LinkRow:
    return LinkRow(
        source=source,
        bucket=bucket,
        wan=source != bucket,
        requests=420,
        bytes_up=up,
        bytes_down=down,
        seconds=12.5,
        megabytes_per_second=(up + down) / 12.5 / 1e6,
        share=share,
        cost_dollars=cost,
        history=history(up // 11, down // 11),
    )


def learner(name: str, region: str) -> LearnerTraffic:
    return LearnerTraffic(
        learner=name,
        region=region,
        tokens=1_200_000,
        delta_bytes_up=48_000_000,
        checkpoint_bytes_up=9_000_000,
        other_bytes_up=120_000,
        bytes_down=51_000_000,
        requests=310,
        retries=2,
        failures=0,
    )


def realistic(**changes) -> TrafficReport:
    """Two regions with two learners each, and a syncer outside both."""
    links = [
        link("eu-west", "eu-west", 114_000_000, 102_000_000, 0.3, 0.01),
        link("us-east", "us-east", 114_000_000, 102_000_000, 0.3, 0.01),
        link("syncer-host", "eu-west", 60_000_000, 70_000_000, 0.2, 6.3),
        link("syncer-host", "us-east", 60_000_000, 70_000_000, 0.2, 6.3),
    ]
    wan = 260_000_000
    fields = dict(
        run="demo-run",
        state="training",
        elapsed_seconds=330.0,
        tokens=4_800_000,
        learners_reporting=4,
        links=links,
        learners=[learner(f"l{i}", region) for i, region in enumerate(("eu-west", "eu-west", "us-east", "us-east"))],
        kinds=[
            KindRow(kind="payload", requests=160, bytes_up=192_000_000, bytes_down=120_000_000, wan_bytes=120_000_000),
            KindRow(kind="update", requests=80, bytes_up=120_000_000, bytes_down=204_000_000, wan_bytes=120_000_000),
            KindRow(kind="heartbeat", requests=900, bytes_up=1_400_000, bytes_down=0, wan_bytes=0),
        ],
        compression=[
            Compression(kind="payload", bytes=192_000_000, raw_fp32_bytes=1_536_000_000),
            Compression(kind="update", bytes=120_000_000, raw_fp32_bytes=960_000_000),
        ],
        data_parallel=DataParallelComparison(
            parameters=124_000_000,
            workers=4,
            tokens_per_step=32_768,
            steps=146.5,
            bytes_per_worker_step=372_000_000,
            total_bytes=146.5 * 4 * 372_000_000,
            region_crossings=2,
            wan_bytes=146.5 * 2 * 372_000_000,
            diloco_wan_bytes=wan,
        ),
        evaluations=[
            Evaluation(version=v, loss=4.2 - 0.3 * v, tokens=600_000 * v, time=START + 40 * v) for v in range(1, 8)
        ],
        started_at=START,
        prices_looked_up="2025-06",
        cost_note=f"list prices looked up 2025-06 {NASTY}",
        total_bytes=866_000_000,
        wan_bytes=wan,
    )
    return TrafficReport(**{**fields, **changes})


def test_the_page_opens_clean_in_a_browser_and_shows_every_table_and_plot(tmp_path):
    report = realistic()
    page = tmp_path / "report.html"
    page.write_text(render_html(report))

    result = open_page(page, TABLES + PLOTS)

    assert result.errors == [] and result.warnings == [], result.console
    assert result.requests[0] == result.url
    assert result.foreign_requests == []
    hidden = {name: element for name, element in result.elements.items() if not element.visible}
    assert not hidden, hidden
    for figure in (
        "demo-run",
        "training",
        "5 min 30 s",
        "4.8M",
        "260.0 MB",
        "54.17 B",  # header: WAN bytes per token
        "syncer-host -> eu-west",
        "eu-west (in region)",
        "l3",
        "heartbeat",
        "8.0x",  # compression
        f"{report.data_parallel.ratio:,.0f}x",
        report.data_parallel.formula,
        "2 of 4 ring hops",
        f"{report.data_parallel.wan_ratio:,.0f}x",
        "$12.62",  # total cost
        NASTY,  # shown as text, never run
    ):
        assert figure in result.text, figure


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
