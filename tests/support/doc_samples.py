"""The samples of what the tool prints, in the README and docs/*.md, each between markers:

    <!-- sample: NAME -->
    ```text
    ...
    ```
    <!-- /sample -->

``python -m tests.support.doc_samples`` writes them all from a real run: it starts the
default job in a temporary directory, takes ``diloco status`` while it trains, then
``diloco report`` once it has finished and ``diloco plan`` for the same links with the
step time the run measured, writes each sample between its markers and shoots
docs/images/report.png from the run's HTML report in headless chromium
(tests/support/browser.py).  ``--run NAME --runs-dir DIR`` takes an existing run instead
(its status as it is now).

tests/unit/test_doc_samples.py renders the same views from a run on disk and fails when
a sample's lines no longer have the shape the tool prints (:func:`shape`): headings,
column names, row names and the words between the figures, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = {
    "status": ROOT / "docs" / "train-your-own.md",
    "report": ROOT / "docs" / "bandwidth.md",
    "plan": ROOT / "docs" / "bandwidth.md",
    "plan-link-rate": ROOT / "docs" / "bandwidth.md",
}
"""Each sample's name and the page it is in."""
REPORT_IMAGE = ROOT / "docs" / "images" / "report.png"
IMAGE_SIZE = (1200, 1500)
PLAN_LINKS = ("--link-mbit", "100", "--latency-ms", "40")
"""The links of the plan's sample (the page says so)."""
FLOOR_PLAN = ("--step-seconds", "5", "--latency-ms", "40")
"""A plan whose link rate the floor of one update in s3fs's read timeout decides."""
TRIMMED = "..."
"""A line of a sample that stands for lines left out."""
BLOCK = re.compile(r"(<!-- sample: (?P<name>[\w-]+) -->\n```text\n)(?P<text>.*?)(```\n<!-- /sample -->)", re.S)


def read_samples(page: Path) -> dict[str, str]:
    """The samples of a page, by name."""
    return {match["name"]: match["text"] for match in BLOCK.finditer(page.read_text())}


def write_sample(name: str, text: str) -> None:
    """Put ``text`` between the markers of sample ``name`` in its page."""
    page = SAMPLES[name]
    content = page.read_text()
    found = [match for match in BLOCK.finditer(content) if match["name"] == name]
    if len(found) != 1:
        raise SystemExit(f"{page}: expected one <!-- sample: {name} --> block, found {len(found)}")
    match = found[0]
    body = "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"
    page.write_text(content[: match.start("text")] + body + content[match.end("text") :])


_SHAPES = (
    (re.compile(r"\s+"), " "),
    (re.compile(r"─+"), "─"),  # a rule as long as its table
    (re.compile(r"\d[\d,]*(\.\d+)?"), "#"),
    (re.compile(r"#[kMB]\b"), "#"),  # 983.0k and 305 are both counts
    (re.compile(r"# (B|kB|MB|GB|TB)\b"), "# B"),
    (re.compile(r"# [kMG]?bit/s"), "# bit/s"),
    (re.compile(r"# (h|min) # (min|s)\b|# (h|min|s)\b"), "# s"),
    (re.compile(r"#[hm]#[ms]\b|#s\b"), "#s"),  # compact durations of table cells
    (re.compile(r"(?<=# )([a-z]+[^s\W])s\b"), r"\1"),  # 1 merge, 2 merges
    (re.compile(r"(?<= )-(?= |$)"), "#"),  # a cell with no figure yet
)


def shape(line: str) -> str:
    """A line with every figure (count, size, duration, share) as ``#``, its plural as
    the singular and its spacing collapsed: what stays when a run differs."""
    for pattern, replacement in _SHAPES:
        line = pattern.sub(replacement, line)
    return line.strip()


def label(line: str) -> str | None:
    """What a line of prose is about, before its first colon (``syncer``, ``fragment #``,
    ``compression of payloads``); None for a line without one (a table's row)."""
    head, colon, _ = shape(line).partition(":")
    return head if colon and len(head) <= 40 else None


def unlike(sample: str, printed: str) -> list[str]:
    """The lines of ``sample`` whose shape the tool's output ``printed`` has nowhere: a
    row or a heading must be there as it is; a line of prose, by its label (what follows
    the colon differs with the state of the run)."""
    shapes = {shape(line) for line in printed.splitlines()}
    labels = {label(line) for line in printed.splitlines()} - {None}
    return [
        line
        for line in sample.splitlines()
        if line.strip() not in ("", TRIMMED) and shape(line) not in shapes and label(line) not in labels
    ]


def trim_report(text: str) -> str:
    """The report's heading and its table per link, then its compression and
    data-parallel lines: what docs/bandwidth.md explains."""
    lines = text.splitlines()
    per_link = next(index for index, line in enumerate(lines) if line.startswith("up: written"))
    compression = next(index for index, line in enumerate(lines) if line.startswith("compression of "))
    cost = next(index for index, line in enumerate(lines) if line.startswith("cost: "))
    return "\n".join(lines[:per_link] + [TRIMMED] + lines[compression:cost])


def link_rate_lines(plan: str) -> str:
    """The plan's last lines: the link rate for the target compute share."""
    lines = plan.splitlines()
    return "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("Link rate for")) :])


def diloco(*arguments: str, cwd: Path) -> str:
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "diloco_cli", *arguments],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"diloco {' '.join(arguments)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def status_of(run: str, where: list[str], cwd: Path) -> dict:
    return json.loads(diloco("status", run, "-o", "json", *where, cwd=cwd))


def shoot(page: Path, image: Path) -> None:
    """A screenshot of the page's top (its figures and plots), as a window shows it."""
    from tests.support.browser import start_browser

    driver = start_browser()
    try:
        driver.set_window_size(*IMAGE_SIZE)
        driver.get(page.resolve().as_uri())
        driver.save_screenshot(str(image))
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.doc_samples", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", help="an existing run to take the samples from (else the default job is started)")
    parser.add_argument("--runs-dir", type=Path, help="where --run is (default: ./runs)")
    parser.add_argument("--mid-run-version", type=int, default=4, help="the version at which status is taken")
    arguments = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="diloco-samples-"))
    if arguments.run:
        run, where = arguments.run, ["--runs-dir", str((arguments.runs_dir or Path("runs")).resolve())]
        status = diloco("status", run, *where, cwd=work)
    else:
        run, where = "demo", ["--runs-dir", str(work / "runs")]
        diloco("up", "--name", run, *where, cwd=work)
        print(f"started the default job in {work}; status at version {arguments.mid_run_version}, then its end")
        while status_of(run, where, work)["version"] < arguments.mid_run_version:
            time.sleep(2)
        status = diloco("status", run, *where, cwd=work)
    while (state := status_of(run, where, work))["state"] not in ("finished", "stopped"):
        time.sleep(5)
    speeds = [row["steps_per_second"] for row in state["learners"] if row["steps_per_second"]]
    step_seconds = len(speeds) / sum(speeds)
    write_sample("status", status)
    write_sample("report", trim_report(diloco("report", run, *where, cwd=work)))
    plan = diloco("plan", *PLAN_LINKS, "--step-seconds", f"{step_seconds:.3f}", cwd=work)
    write_sample("plan", plan)
    write_sample("plan-link-rate", link_rate_lines(diloco("plan", *FLOOR_PLAN, cwd=work)))
    diloco("report", run, *where, "--html", str(work / "report.html"), cwd=work)
    shoot(work / "report.html", REPORT_IMAGE)
    print(f"wrote the samples {', '.join(SAMPLES)} and {REPORT_IMAGE.relative_to(ROOT)} from run {run}")


if __name__ == "__main__":
    main()
