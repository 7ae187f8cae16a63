"""The samples of what the tool prints in the README and docs/*.md (written from a real
run by ``python -m tests.support.doc_samples``) against what the tool prints now: the
same headings, columns, rows and words between the figures (issue 32, 3)."""

import pytest
from click.testing import CliRunner

from diloco_cli.bandwidth.prices import load_prices
from diloco_cli.cli.app import app
from diloco_cli.views.report import collect_report
from diloco_cli.views.report import render_plain as render_report
from diloco_cli.views.report_html import render_html
from diloco_cli.views.run_state import collect_status
from diloco_cli.views.status import render_plain as render_status
from tests.support.doc_samples import (
    FLOOR_PLAN,
    PLAN_LINKS,
    REPORT_IMAGE,
    ROOT,
    SAMPLES,
    link_rate_lines,
    read_samples,
    unlike,
)
from tests.support.runs_on_disk import beat, make_run, run_secret, syncer_status
from tests.support.traffic_report import realistic

LEARNERS = ("local-a-0", "local-a-1", "local-b-0", "local-b-1")


def sample(name: str) -> str:
    found = read_samples(SAMPLES[name])
    assert found.get(name, "").strip(), f"{SAMPLES[name]} has no <!-- sample: {name} --> block with output in it"
    return found[name]


def on_disk(tmp_path, state: str):
    """The default job as its documents show it, named as the samples' run."""
    _, spec = make_run(tmp_path, "demo")
    for learner in LEARNERS:
        beat(spec, learner, 120, state="training" if state == "running" else state)
    syncer_status(spec, state=state)
    return spec


def test_every_sample_is_in_its_page():
    for name in SAMPLES:
        sample(name)


def test_the_status_sample_has_the_lines_status_prints(tmp_path):
    spec = on_disk(tmp_path, "running")
    printed = render_status(collect_status(spec, run_secret(spec)))
    assert unlike(sample("status"), printed) == [], printed


def test_the_report_sample_has_the_lines_and_links_report_prints(tmp_path):
    spec = on_disk(tmp_path, "finished")
    printed = render_report(collect_report(spec, run_secret(spec), load_prices()))
    assert "local-a -> local-b" in printed  # the syncer in local-a, as the default job places it
    assert unlike(sample("report"), printed) == [], printed


def test_the_plan_samples_have_the_lines_plan_prints():
    runner = CliRunner()
    printed = runner.invoke(app, ["plan", *PLAN_LINKS, "--step-seconds", "0.8"])
    assert printed.exit_code == 0, printed.output
    assert unlike(sample("plan"), printed.output) == [], printed.output
    floor = runner.invoke(app, ["plan", *FLOOR_PLAN])
    assert floor.exit_code == 0, floor.output
    assert unlike(sample("plan-link-rate"), link_rate_lines(floor.output)) == [], floor.output


def test_a_sample_from_an_older_format_is_told_apart(tmp_path):
    """What the check catches: the report's sample as it was (a ``syncer -> local-a``
    link, no column of HTTP heads)."""
    spec = on_disk(tmp_path, "finished")
    printed = render_report(collect_report(spec, run_secret(spec), load_prices()))
    older = (
        " link                  WAN         up      down   requests   MB/s   share      cost\n"
        " syncer -> local-a     yes    18.2 MB   10.9 MB        829   20.9    9.2%   $0.0000\n"
    )
    assert unlike(older, printed) == older.splitlines()


def test_the_page_counts_the_html_reports_plots_and_its_image_is_there():
    pytest.importorskip("matplotlib")
    plots = render_html(realistic()).count("<figure")
    page = " ".join((ROOT / "docs" / "bandwidth.md").read_text().split())
    assert f"{ {3: 'three', 4: 'four', 5: 'five', 6: 'six'}[plots] } plots" in page
    assert REPORT_IMAGE.stat().st_size > 10_000 and "(docs/images/report.png)" in (ROOT / "README.md").read_text()
