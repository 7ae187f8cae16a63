"""``diloco report --html``'s page opened in a real headless browser (tests/support/browser.py)."""

from diloco_cli.views.report_html import render_html
from tests.support.browser import open_page
from tests.support.traffic_report import NASTY, PLOTS, TABLES, realistic


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
        report.data_parallel.formula,
        report.data_parallel.hierarchical_formula,
        "at equal tokens",
        "2 of 4 ring hops",
        f"{report.data_parallel.wan_ratio:,.0f}x",
        f"{report.data_parallel.hierarchical_wan_ratio:,.0f}x",
        "$12.62",  # total cost
        NASTY,  # shown as text, never run
    ):
        assert figure in result.text, figure
