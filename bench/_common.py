"""What every benchmark shares: timing, the machine's description, JSON results, tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def seconds(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def copy_seconds(source: torch.Tensor, destination: torch.Tensor) -> float:
    """The physical reference: copy a buffer into a preallocated one."""
    return seconds(lambda: destination.copy_(source))


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain"], capture_output=True, text=True, cwd=Path(__file__).parent
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    return {
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": commit,
        "git_dirty": dirty,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def result_path(name: str, quick: bool, output: Path | None) -> Path:
    """Where a benchmark's JSON goes: ``--output``, else ``bench/results/NAME[.quick].json``."""
    return output or RESULTS / f"{name}{'.quick' if quick else ''}.json"


def write_result(name: str, quick: bool, settings: dict[str, Any], results: Any, output: Path | None) -> Path:
    """Write ``{"benchmark", "machine", "settings", "results"}`` as JSON and return the path."""
    path = result_path(name, quick, output)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": name, "quick": quick, "machine": machine(), "settings": settings, "results": results}
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def benchmark_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring's first line, ``--quick`` (what
    the test suite runs) and ``--output``; the benchmark adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument(
        "--output", type=Path, help="where to write the JSON result (default: bench/results/NAME[.quick].json)"
    )
    return parser


def write_and_report(
    name: str, args: argparse.Namespace, settings: dict[str, Any], results: Any, note: str = ""
) -> Path:
    """Write the result as :func:`write_result` does (``args.quick``, ``args.output``),
    then print ``wrote PATH`` (and ``note``) as the benchmark's last line."""
    path = write_result(name, args.quick, settings, results, args.output)
    print(f"wrote {path}{note}")
    return path


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    widths = [max(len(column), *(len(cell(row.get(column, ""))) for row in rows)) for column in columns]
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)))
    for row in rows:
        print("  ".join(cell(row.get(column, "")).ljust(width) for column, width in zip(columns, widths)))


def local_regions(directory: Path, learners: int) -> Path | None:
    """A regions file with ``learners`` split over the default's two local regions
    (``local-a`` takes the odd one), or None where the default regions place as many."""
    from diloco_cli.config.regions import RegionsFile

    if learners == sum(region.num_learners for region in RegionsFile().regions):
        return None
    per_region = {"local-a": learners - learners // 2, "local-b": learners // 2}
    regions = [
        {
            "name": name,
            "bucket": f"file://{{runs_dir}}/{{run}}/buckets/{name}",
            "hosts": [{"name": "local", "learners": count}],
        }
        for name, count in per_region.items()
        if count
    ]
    path = directory / f"regions-{learners}.json"
    path.write_text(json.dumps({"regions": regions}))
    return path


LEARNERS_START_SECONDS = 300.0
"""How long a benchmark's run may take until every learner has trained."""


def wait_until_every_learner_trained(runs_dir: Path, name: str, timeout: float = LEARNERS_START_SECONDS) -> None:
    """Return once every learner of run ``name`` has been seen training (or past step 0):
    where a benchmark's clock starts.  Each learner counts once seen, since learners killed
    every few seconds are seldom all training at one instant.  If that takes longer than
    ``timeout``, or the run ends first, the run is stopped and RuntimeError raised."""
    from diloco_cli.launch.operations import stop_run
    from diloco_cli.launch.runs import load_run
    from diloco_cli.views.run_state import collect_status

    spec = load_run(runs_dir, name).spec
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while True:
        status = collect_status(spec)
        seen |= {row.learner for row in status.learners if row.state == "training" or row.step > 0}
        if len(seen) == len(spec.learners):
            return
        if status.state == "finished" or time.monotonic() > deadline:
            stop_run(load_run(runs_dir, name))
            raise RuntimeError(
                f"run {name}: only {sorted(seen)} of {len(spec.learners)} learners trained within {timeout:.0f} s "
                f"(state {status.state})"
            )
        time.sleep(0.5)
