"""A region's bucket wiped mid-run (everything under the run's root deleted, the folder
recreated empty): the syncer notices the region's head and updates are gone and catches
it up, the region's reducer goes on from nothing, and merges resume within 30 s; wiped
near the end, the run still ends and no finished learner is told to resync."""

import re
import shutil
import time
from pathlib import Path

import pytest

from diloco_cli.launch.runs import load_run
from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    audit_ledger,
    deep_update,
    diloco,
    histories,
    logs_of,
    wait_finished,
    wait_for,
    write_yaml,
)

pytestmark = pytest.mark.slow

RESUME_SECONDS = 30.0
"""Merges resume within this long of a wipe (issue 31)."""


def start_run(tmp_path: Path, name: str, inner_steps: int) -> Path:
    runs_dir = tmp_path / "runs"
    recipe = write_yaml(
        tmp_path / "tiny.yaml",
        deep_update(
            TINY_RECIPE,
            {
                "training": {"num_learners": 2, "inner_steps": inner_steps, "checkpoint_every_steps": 40},
                "sync": {"liveness_timeout_seconds": 15, "give_up_seconds": 30},
            },
        ),
    )
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {"name": region, "bucket": f"file://{tmp_path}/buckets/{region}", "hosts": [{"name": "local"}]}
                for region in ("east", "west")
            ]
        },
    )
    up = ("up", str(recipe), "--regions", str(regions), "--name", name, "--runs-dir", str(runs_dir))
    diloco(*up, "--chaos", "keep-payloads")  # the audit reads every payload
    return runs_dir


def wipe(runs_dir: Path, name: str, region: str) -> float:
    """Everything of the run in ``region``'s bucket gone at once and its folder recreated
    empty, as a bucket deleted and made again; returns when (wall clock)."""
    root = Path(next(r.root for r in load_run(runs_dir, name).spec.regions if r.name == region).removeprefix("file://"))
    gone = root.with_name(root.name + ".wiped")
    root.rename(gone)
    root.mkdir()
    wiped_at = time.time()
    shutil.rmtree(gone, ignore_errors=True)
    return wiped_at


def commit_times(runs_dir: Path, name: str) -> list[float]:
    record = load_run(runs_dir, name)
    return sorted(commit.time for shard in histories(record.spec, record.secret()) for commit in shard)


def test_a_region_wiped_mid_run_merges_again_within_30_seconds(tmp_path):
    name = "wiped"
    runs_dir = start_run(tmp_path, name, inner_steps=2400)
    wait_for(runs_dir, name, lambda s: s.version >= 6, 180, "version 6")
    wiped_at = wipe(runs_dir, name, "east")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not [t for t in commit_times(runs_dir, name) if t > wiped_at]:
        time.sleep(0.5)
    after = [t for t in commit_times(runs_dir, name) if t > wiped_at]
    assert after, f"nothing merged within 90 s of the wipe\n{logs_of(runs_dir, name)}"
    assert after[0] - wiped_at <= RESUME_SECONDS, f"merges resumed {after[0] - wiped_at:.0f} s after the wipe"
    status = wait_finished(runs_dir, name, timeout=300)
    assert all(row.state == "finished" for row in status.learners), status.learners
    record = load_run(runs_dir, name)
    audit_ledger(record.directory, record.secret())
    assert_bases_are_the_syncers(runs_dir, name)
    logs = {path.stem: path.read_text() for path in (runs_dir / name / "logs").glob("*.log")}
    assert re.search(r"region east lost .*wiped", logs["syncer"]), logs["syncer"][-4000:]
    assert "wiped" in logs["reducer-east"], logs["reducer-east"][-4000:]


def test_a_region_wiped_near_the_end_still_ends_and_resyncs_no_finished_learner(tmp_path):
    name = "wiped-late"
    steps = 800
    runs_dir = start_run(tmp_path, name, inner_steps=steps)
    wait_for(
        runs_dir,
        name,
        lambda s: min(row.step for row in s.learners) >= steps - 150,
        240,
        "the learners near their end",
    )
    wipe(runs_dir, name, "east")
    learners_done = wait_for(
        runs_dir, name, lambda s: all(row.state == "finished" for row in s.learners), 120, "the learners finishing"
    )
    assert learners_done
    finished_at = time.monotonic()
    status = wait_finished(runs_dir, name, timeout=90)
    assert time.monotonic() - finished_at <= 90
    assert all(row.state == "finished" for row in status.learners), status.learners
    logs = "\n".join(path.read_text() for path in (runs_dir / name / "logs").glob("*.log"))
    assert not re.search(r"told \S+ to resync", logs), "a learner was told to resync"
    record = load_run(runs_dir, name)
    audit_ledger(record.directory, record.secret())
    assert_bases_are_the_syncers(runs_dir, name)
