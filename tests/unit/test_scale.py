"""``diloco scale``: learners added to a running run start from the global weights with a
slice of the data of their own; drained learners send what they trained and stop; the
syncer's M follows; the run's record and ``status`` keep the changes."""

import json
import time

import pytest

from diloco_cli.codec import RunSecret
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.types import LearnerId, RegionName
from diloco_cli.launch.runs import load_run
from diloco_cli.launch.scale import parse_change, plan_scale
from diloco_cli.runtime.membership import ControlNotes
from diloco_cli.store.run_spec import LearnerSpec, RegionSpec, RunSpec, SyncerSpec
from tests.support.runs import (
    TINY_RECIPE,
    assert_every_token_accounted,
    deep_update,
    diloco,
    heartbeats,
    wait_finished,
    wait_for,
    write_yaml,
)


def _spec(tmp_path, quorum=None, learners=(("east", "h1"), ("east", "h2"), ("west", "h3"))) -> RunSpec:
    recipe = Recipe.model_validate(
        deep_update(TINY_RECIPE, {"training": {"num_learners": len(learners)}, "sync": {"quorum": quorum}})
    )
    counts: dict[str, int] = {}
    placed = []
    for shard, (region, host) in enumerate(learners):
        index = counts[region] = counts.get(region, -1) + 1
        placed.append(LearnerSpec(id=LearnerId(f"{region}-{index}"), region=RegionName(region), host=host, shard=shard))
    regions = tuple(RegionSpec(name=RegionName(n), root=f"file://{tmp_path}/{n}") for n in ("east", "west"))
    return RunSpec(
        run="r",
        created=0.0,
        recipe=recipe,
        learners=tuple(placed),
        regions=regions,
        syncer=SyncerSpec(host="local", home=f"file://{tmp_path}/home"),
    )


def test_adding_places_new_learners_on_the_least_loaded_host_with_shards_after_everyone(tmp_path):
    spec = plan_scale(_spec(tmp_path), "east", +3, now=5.0)
    added = spec.learners[3:]
    assert [(learner.id, learner.host, learner.shard) for learner in added] == [
        ("east-2", "h1", 3),
        ("east-3", "h2", 4),
        ("east-4", "h1", 5),
    ]
    assert spec.recipe.training.num_learners == 6 and spec.recipe.quorum == 6  # K left to M follows M
    assert spec.scaling[-1].added == ("east-2", "east-3", "east-4") and spec.scaling[-1].learners_after == 6
    # every active learner gets a slice of its own, in shard order
    assert sorted(spec.data_partition(learner.id) for learner in spec.learners) == [(i, 6) for i in range(6)]
    assert _spec(tmp_path).data_partition("west-0") == (2, 3)  # before any scaling: (shard, M)


def test_draining_marks_the_newest_learners_and_m_and_the_slices_follow(tmp_path):
    spec = plan_scale(_spec(tmp_path), "east", -1, now=5.0)
    assert [learner.id for learner in spec.learners if learner.drain] == ["east-1"]
    assert [learner.id for learner in spec.active_learners] == ["east-0", "west-0"]
    assert spec.recipe.training.num_learners == 2 and spec.data_partition("west-0") == (1, 2)
    again = plan_scale(spec, "east", +1, now=6.0)  # a drained learner's name is not reused
    assert again.learners[-1].id == "east-2" and len(again.scaling) == 2


def test_scale_mistakes_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="not a region of run r .*east, west"):
        plan_scale(_spec(tmp_path), "north", +1, 0.0)
    with pytest.raises(ConfigError, match="region west has 1 active learner.*cannot drain 2"):
        plan_scale(_spec(tmp_path), "west", -2, 0.0)
    with pytest.raises(ConfigError, match="cannot exceed.*lower sync.quorum first"):
        plan_scale(_spec(tmp_path, quorum=3), "east", -1, 0.0)
    with pytest.raises(ConfigError, match="without learners"):
        plan_scale(_spec(tmp_path, learners=(("east", "h1"),)), "east", -1, 0.0)
    assert parse_change("+2") == 2 and parse_change("-1") == -1
    for bad in ("2", "0", "+x", "-0"):
        with pytest.raises(ConfigError, match="signed count"):
            parse_change(bad)


def test_control_notes_carry_drain_and_slices_and_keep_resync_requests(tmp_path):
    secret = RunSecret(bytes(32))
    spec = plan_scale(_spec(tmp_path), "east", -1, now=5.0)
    buckets = {region.name: spec.bucket(region.name, secret) for region in spec.regions}
    notes = ControlNotes(buckets, refused=lambda *args: None)
    notes.resync(LearnerId("west-0"), "west", 1, "too stale")
    notes.follow(spec)
    notes.deliver()
    assert not notes.due
    west = buckets["west"].read_control(LearnerId("west-0"))
    assert (west.resync_serial, west.drain, west.data_slice, west.data_slices) == (
        1,
        False,
        1,
        2,
    )  # the resync request survives
    drained = buckets["east"].read_control(LearnerId("east-1"))
    assert drained.drain and drained.data_slices is None
    fresh = ControlNotes(buckets, refused=lambda *args: None)  # a restarted syncer: nothing more to write
    fresh.follow(spec)
    assert not fresh.due


@pytest.mark.slow
def test_scaling_a_running_run_up_and_down(tmp_path):
    """+1: the new learner starts from the newest global weights, its payloads are merged
    and M=3; -1: it sends what it trained and stops before its steps are done, and the
    run finishes with every token of every learner merged or accounted for."""
    runs_dir, name = tmp_path / "runs", "scaled"
    recipe = write_yaml(tmp_path / "recipe.yaml", deep_update(TINY_RECIPE, {"training": {"inner_steps": 900}}))
    regions = [
        {"name": n, "bucket": f"file://{tmp_path}/buckets/{n}", "hosts": [{"name": "local", "learners": 1}]}
        for n in ("east", "west")
    ]
    regions_file = write_yaml(tmp_path / "regions.yaml", {"regions": regions})
    diloco("up", str(recipe), "--regions", str(regions_file), "--name", name, "--runs-dir", str(runs_dir))
    wait_for(runs_dir, name, lambda s: s.version >= 2, 120, "the first merges")

    added = diloco("scale", name, "--region", "east", "--learners", "+1", "--runs-dir", str(runs_dir)).stdout
    assert "added east-1 in region east; M is now 3 (K=3)" in added
    record = load_run(runs_dir, name)
    assert [learner.id for learner in record.spec.learners] == ["east-0", "west-0", "east-1"]
    assert record.spec.scaling[0].added == ("east-1",)
    history_of = lambda: record.spec.home(record.secret()).history()  # noqa: E731
    deadline = time.monotonic() + 180
    while not any(m.learner == "east-1" for c in history_of() for m in c.merged):
        assert time.monotonic() < deadline, "no payload of the added learner was merged"
        time.sleep(2)
    syncer_log = (runs_dir / name / "logs" / "syncer.log").read_text()
    assert "the run now has M=3 learners, K=3; added east-1" in syncer_log
    new_log = (runs_dir / name / "logs" / "east-1.log").read_text()
    assert "installed fragment" in new_log and "resumed from checkpoint" not in new_log  # from the global weights
    notes = {
        learner.id: record.spec.bucket(learner.region, record.secret()).read_control(learner.id)
        for learner in record.spec.learners
    }
    assert sorted((n.data_slice, n.data_slices) for n in notes.values()) == [(0, 3), (1, 3), (2, 3)]
    assert "training on slice 1 of 3" in (runs_dir / name / "logs" / "west-0.log").read_text()
    status = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    assert status["scaling"].startswith("scaled: M=3 after 1 change: +1 in east")

    drained = diloco("scale", name, "--region", "east", "--learners", "-1", "--runs-dir", str(runs_dir), timeout=400)
    assert "draining east-1 in region east; M is now 2" in drained.stdout
    assert "east-1           drained: it stopped, and all" in drained.stdout
    beat = heartbeats(runs_dir, name)["east-1"]
    assert beat.state.value == "finished" and beat.step < 900  # left early, its work delivered
    # its supervisor records the exit a moment after the last heartbeat: finished, never restarted
    deadline = time.monotonic() + 60
    while (process := load_run(runs_dir, name).process_state("east-1"))[
        "state"
    ] == "running" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert process["state"] == "finished" and process["restarts"] == 0, process
    listed = json.loads(diloco("runs", "--output", "json", "--runs-dir", str(runs_dir)).stdout)
    assert [(run["name"], run["learners"]) for run in listed] == [(name, 2)]  # M now
    assert "draining east-1" in (runs_dir / name / "logs" / "syncer.log").read_text()

    final = wait_finished(runs_dir, name, timeout=400)
    assert {row.learner: row.state for row in final.learners} == {
        "east-0": "finished",
        "west-0": "finished",
        "east-1": "drained",
    }
    assert_every_token_accounted(runs_dir, name, heartbeats(runs_dir, name))
    assert len(load_run(runs_dir, name).spec.scaling) == 2
    refused = diloco("scale", name, "--region", "east", "--learners", "+1", "--runs-dir", str(runs_dir), check=False)
    assert refused.returncode == 2 and "has finished; there is nothing to scale" in refused.stderr


def test_dynamic_local_updates_reach_learners_through_their_notes_without_jitter(tmp_path):
    secret = RunSecret(bytes(32))
    spec = _spec(tmp_path)  # H = 10
    buckets = {region.name: spec.bucket(region.name, secret) for region in spec.regions}
    notes = ControlNotes(buckets, refused=lambda *args: None)
    notes.follow_speeds(spec, {"east-0": 0.1, "east-1": 0.2, "west-0": 0.1})
    notes.deliver()
    intervals = [buckets[learner.region].read_control(learner.id).sync_interval for learner in spec.learners]
    assert intervals == [None, 5, None]
    notes.follow_speeds(spec, {"east-0": 0.1, "east-1": 0.21, "west-0": 0.1})  # H_m 4: moved by 1 of H=10, written
    assert notes.due and notes.notes["east-1"].sync_interval == 4
