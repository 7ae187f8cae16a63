"""A region's storage goes down in the middle of a run (chaos mode, injected in the store
layer): its learner keeps training and keeps its unsent payloads, the syncer skips the
region and merges the other one meanwhile, and when the storage returns the region is
caught up and every token is accounted for."""

import json
import time

import pytest

from diloco_cli.config.chaos import parse_chaos
from diloco_cli.config.errors import ConfigError
from diloco_cli.store.faults import StorageFaults
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


def test_chaos_specs_parse_and_mistakes_say_what_is_wrong():
    plan = parse_chaos(
        "seed=3,kill-learner=0.5/min,stop-learner=2/h:10s,outage=west@1m+30s:hang,outage-rate=0.1/min:20s"
    )
    assert (
        plan.kill_learner_per_minute == 0.5
        and plan.stop_learner_per_minute == pytest.approx(2 / 60)
        and plan.stop_seconds == 10
    )
    assert plan.outages[0].region == "west" and plan.outages[0].start_seconds == 60 and plan.outages[0].mode == "hang"
    windows = plan.outage_windows(["east", "west"])
    assert windows == parse_chaos("seed=3,outage=west@60s+30s:hang,outage-rate=0.1/min:20s").outage_windows(
        ["east", "west"]
    )  # reproducible
    assert windows != parse_chaos("seed=4,outage=west@60s+30s:hang,outage-rate=0.1/min:20s").outage_windows(
        ["east", "west"]
    )
    for bad, message in (
        ("kill=1/min", "KEY one of"),
        ("kill-learner=fast", "not a rate"),
        ("outage=west", r"REGION@START\+DURATION"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_chaos(bad)


def test_an_outage_window_fails_calls_only_inside_it():
    now = [100.0]
    faults = StorageFaults.of(parse_chaos("outage=west@10s+5s"), "west", ["east", "west"], started_at=80.0)
    faults._clock = lambda: now[0]
    assert StorageFaults.of(parse_chaos("outage=west@10s+5s"), "east", ["east", "west"], 80.0) is None
    faults.check("reading x")  # 20 s after the start: the window is 10 s to 15 s
    now[0] = 92.0
    with pytest.raises(ConnectionError, match="chaos: the storage of region west is down"):
        faults.check("reading x")
    now[0] = 95.0
    faults.check("reading x")
    # a plan given to a running run (`diloco chaos`) counts its times from then
    later = parse_chaos("outage=west@10s+5s").model_copy(update={"begins_at_seconds": 100.0})
    windows = StorageFaults.of(later, "west", ["east", "west"], started_at=80.0).windows
    assert [(w.start, w.end) for w in windows] == [(190.0, 195.0)]


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
