"""A region's storage goes down in the middle of a run (chaos mode, injected in the store
layer): its learner keeps training and keeps its unsent payloads, the syncer skips the
region and merges the other one meanwhile, and when the storage returns the region is
caught up and every token is accounted for."""

import json
import time

import pytest

from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    assert_every_token_accounted,
    deep_update,
    diloco,
    heartbeats,
    wait_finished,
    wait_for,
    write_yaml,
)


@pytest.mark.slow
def test_a_region_down_for_a_while_costs_only_its_share_and_heals(tmp_path):
    """The outage is injected into the running run with `diloco chaos`."""
    runs_dir, name = tmp_path / "runs", "outage"
    # K=1: east merges alone meanwhile; a window of kept updates long enough that west's
    # payloads from before the outage can still be anchored (beyond it, west would resync)
    changes = {
        "training": {"inner_steps": 1500},
        "sync": {"quorum": 1, "window_versions": 2000},
        "storage": {"attempts": 2, "max_backoff_seconds": 1.0},
    }
    recipe = write_yaml(tmp_path / "recipe.yaml", deep_update(TINY_RECIPE, changes))
    regions = [
        {"name": n, "bucket": f"file://{tmp_path}/buckets/{n}", "hosts": [{"name": "local", "learners": 1}]}
        for n in ("east", "west")
    ]
    regions_file = write_yaml(tmp_path / "regions.yaml", {"regions": regions})
    diloco("up", str(recipe), "--regions", str(regions_file), "--name", name, "--runs-dir", str(runs_dir))
    wait_for(runs_dir, name, lambda s: s.version >= 2, 120, "the first merges")
    # the outage is given to the running run (`diloco chaos`): every process follows its manifest
    given = diloco("chaos", name, "outage=west@3s+15s", "--runs-dir", str(runs_dir)).stdout
    assert "outages: west from 3 s for 15 s from now" in given
    # during the outage: status says so, and the syncer keeps merging east
    during = wait_for(
        runs_dir, name, lambda s: "west" in s.syncer.unreachable, 60, "the syncer seeing west unreachable"
    )
    assert any("region west is unreachable from the syncer" in problem for problem in during.problems)
    version_then = during.version
    time.sleep(5)
    still = wait_for(
        runs_dir,
        name,
        lambda s: "west" in s.syncer.unreachable and s.version > version_then,
        30,
        "east merging during the outage",
    )
    assert still.version > version_then
    status = wait_finished(runs_dir, name, timeout=300)
    assert not status.syncer.unreachable and status.syncer.outages >= 1
    beats = heartbeats(runs_dir, name)
    assert_every_token_accounted(runs_dir, name, beats)  # nothing west trained was lost
    assert_bases_are_the_syncers(runs_dir, name)  # and west was caught up exactly
    west_log = (runs_dir / name / "logs" / "west-0.log").read_text()
    assert "chaos: the storage of region west is down" in west_log and "finished at step 1500" in west_log
    syncer_log = (runs_dir / name / "logs" / "syncer.log").read_text()
    assert "region west is unreachable" in syncer_log and "region west is reachable again" in syncer_log
    assert "the run's chaos plan changed" in syncer_log and "the run's chaos plan changed" in west_log
    report = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    assert report["syncer"]["outages"] >= 1


@pytest.mark.slow
def test_chaos_mode_kills_and_pauses_processes_and_the_run_still_finishes_exactly(tmp_path):
    """`diloco up --chaos`: learners and the syncer SIGKILLed, learners SIGSTOPped for a
    while, on a seeded schedule; every event is in `status`, the supervisors bring the
    processes back, and the ledger holds (final bases are the syncer's weights)."""
    runs_dir, name = tmp_path / "runs", "chaos"
    recipe = write_yaml(
        tmp_path / "recipe.yaml", deep_update(TINY_RECIPE, {"training": {"inner_steps": 800}, "sync": {"quorum": 1}})
    )
    regions = [
        {"name": n, "bucket": f"file://{tmp_path}/buckets/{n}", "hosts": [{"name": "local", "learners": 1}]}
        for n in ("east", "west")
    ]
    regions_file = write_yaml(tmp_path / "regions.yaml", {"regions": regions})
    # seed 2's first events: the syncer and west-0 killed at 3.8 s, both learners stopped at
    # ~10 s, the syncer killed again at 14.2 s: all while the learners train
    spec = "seed=2,kill-learner=6/min,kill-syncer=3/min,stop-learner=6/min:3s"
    diloco(
        "up", str(recipe), "--regions", str(regions_file), "--name", name, "--runs-dir", str(runs_dir), "--chaos", spec
    )
    wait_for(
        runs_dir,
        name,
        lambda s: s.chaos is not None and "process faults injected" in s.chaos,
        90,
        "a fault injected and shown",
    )
    status = wait_finished(runs_dir, name, timeout=400)
    assert "process faults injected" in status.chaos
    assert_bases_are_the_syncers(runs_dir, name)
    driver_log = (runs_dir / name / "logs" / "chaos.log").read_text()
    assert "kill" in driver_log and ("stop" in driver_log or "kill syncer" in driver_log)
    text = diloco("status", name, "--runs-dir", str(runs_dir)).stdout
    assert "chaos:" in text
