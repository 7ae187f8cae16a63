"""``diloco report`` on a real run, running and finished: plain text when piped, JSON,
rich tables in a terminal (tmux), and an HTML page opened in a headless browser."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

from tests.support.browser import open_page
from tests.support.runs import TINY_RECIPE, deep_update, diloco, wait_finished, wait_for, write_yaml

PAGE_IDS = (
    "table-links",
    "table-learners",
    "table-kinds",
    "table-compression",
    "table-data-parallel",
    "plot-bytes",
    "plot-rates",
    "plot-loss-tokens",
    "plot-loss-time",
)


def report_json(runs_dir, name) -> dict:
    return json.loads(diloco("report", name, "--output", "json", "--runs-dir", str(runs_dir)).stdout)


def check_page(path, report: dict) -> str:
    page = open_page(path, PAGE_IDS)
    assert not page.errors and not page.warnings, page.console
    assert not page.foreign_requests, page.foreign_requests
    for element in PAGE_IDS:
        assert page.elements[element].visible, (element, page.elements[element])
    assert report["run"] in page.text and "local-a -> local-b" in page.text
    return page.text


def in_terminal(command: str, columns: int = 150) -> str:
    session = f"diloco-report-{time.monotonic_ns()}"
    subprocess.run(
        [
            "tmux",
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            str(columns),
            "-y",
            "60",
            f"{command}; echo REPORT-ENDED; sleep 30",
        ],
        check=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-e", "-S", "-", "-t", session], capture_output=True, text=True
            ).stdout  # with what scrolled off
            if "REPORT-ENDED" in screen:
                return screen
            time.sleep(0.3)
        raise AssertionError(f"the report never ended in the terminal:\n{screen}")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_report_of_a_running_and_a_finished_run_in_every_form(tmp_path):
    runs_dir, name = tmp_path / "runs", "reported"
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(TINY_RECIPE, {"training": {"inner_steps": 400}}))
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": region,
                    "bucket": f"file://{tmp_path}/buckets/{region}",
                    "hosts": [{"name": "local", "learners": 1}],
                }
                for region in ("local-a", "local-b")
            ]
        },
    )
    diloco("up", str(recipe), "--regions", str(regions), "--name", name, "--runs-dir", str(runs_dir))
    wait_for(runs_dir, name, lambda status: status.version >= 3, 180, "version 3")

    running = report_json(runs_dir, name)
    assert running["state"] == "running" and 0 < running["tokens"] < 2 * 400 * 8 * 64
    links = {(link["source"], link["bucket"]): link for link in running["links"]}
    # the syncer in local-a (the default): only its traffic with local-b crosses a link
    assert set(links) == {("local-a", "local-a"), ("local-b", "local-b"), ("local-a", "local-b")}
    assert not links["local-a", "local-a"]["wan"] and links["local-a", "local-b"]["wan"]
    assert abs(sum(link["share"] for link in running["links"]) - 1) < 1e-9
    assert running["wan_bytes"] == sum(
        link["bytes_up"] + link["bytes_down"] for link in running["links"] if link["wan"]
    )
    piped = diloco("report", name, "--html", str(tmp_path / "running.html"), "--runs-dir", str(runs_dir)).stdout
    assert "per link" in piped and "local-a -> local-b" in piped and "\x1b[" not in piped
    assert "2 (M-1)/M x 2 bytes x parameters" in piped
    check_page(tmp_path / "running.html", running)
    status = diloco("status", name, "--runs-dir", str(runs_dir)).stdout
    assert "bandwidth:" in status and "across links" in status

    wait_finished(runs_dir, name, timeout=300)
    finished = report_json(runs_dir, name)
    assert finished["state"] == "finished" and finished["tokens"] == 2 * 400 * 8 * 64
    assert finished["wan_bytes"] > running["wan_bytes"] and finished["evaluations"]
    links = [(link["source"], link["bucket"]) for link in finished["links"]]
    assert len(links) == len(set(links)) == 3  # the syncer in local-a shares local-a's in-region link
    kinds = {row["kind"]: row for row in finished["kinds"]}
    assert kinds["checkpoint"]["wan_bytes"] == 0 and 0 < kinds["update"]["wan_bytes"] < kinds["update"]["bytes_up"]
    # with reducers no payload and no snapshot crosses a link (none at version 0 either):
    # aggregates, updates, heads and small documents do
    assert kinds["payload"]["wan_bytes"] == 0 and kinds["payload"]["bytes_up"] > 0
    assert kinds.get("snapshot", {"wan_bytes": 0})["wan_bytes"] == 0
    assert kinds["aggregate"]["wan_bytes"] > 0
    learner = finished["learners"][0]
    assert learner["checkpoint_bytes_up"] > 0 and learner["delta_bytes_up"] > 0  # apart, not one "bytes up"
    dp = finished["data_parallel"]
    assert dp["steps"] == finished["tokens"] / (2 * 8 * 64) and dp["wan_ratio"] > 1
    diloco("report", name, "--html", str(tmp_path / "finished.html"), "--runs-dir", str(runs_dir))
    text = check_page(tmp_path / "finished.html", finished)
    assert "finished" in text

    screen = in_terminal(
        f"env -u COLUMNS -u LINES {shlex.quote(sys.executable)} -m diloco_cli report {name} "
        f"--runs-dir {shlex.quote(str(runs_dir))}"
    )
    assert "\x1b[" in screen and "per link" in screen and "local-a -> local-b" in screen and "per kind" in screen
