"""``diloco scale``'s plan: where added learners go and which ones drain, the M and data
slices that follow, and the control notes that carry them to the learners (a running run
scaled up and down: tests/integration/test_scale_running.py)."""

import pytest

from diloco_cli.codec import RunSecret
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.types import LearnerId, RegionName
from diloco_cli.launch.scale import parse_change, plan_scale
from diloco_cli.runtime.membership import ControlNotes
from diloco_cli.store.run_spec import LearnerSpec, RegionSpec, RunSpec, SyncerSpec
from tests.support.runs import (
    TINY_RECIPE,
    deep_update,
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
    with pytest.raises(ConfigError) as quorum:
        plan_scale(_spec(tmp_path, quorum=2), "east", -2, 0.0)
    assert str(quorum.value) == (  # the M it would leave, and the M it has
        "draining east-1, east-0 would leave run r with M=1 learners, fewer than its quorum K=2 (it has M=3 now); "
        "drain at most 1 (a run's sync.quorum is set when it starts)"
    )
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


def test_a_learner_added_on_a_gpu_host_takes_a_gpu_no_active_learner_holds(tmp_path):
    spec = _spec(tmp_path, learners=(("east", "gpu"), ("east", "gpu")))
    spec = spec.model_copy(
        update={
            "learners": tuple(learner.model_copy(update={"devices": (n,)}) for n, learner in enumerate(spec.learners))
        }
    )
    with pytest.raises(ConfigError, match=r"host gpu: 0 of its GPUs 0, 1 are free, a learner needs 1 \(held by east-0"):
        plan_scale(spec, "east", +1, now=5.0)
    drained = plan_scale(spec, "east", -1, now=5.0)  # east-1 leaves: GPU 1 is free again
    added = plan_scale(drained, "east", +1, now=6.0).learners[-1]
    assert (added.host, added.devices) == ("gpu", (1,))


def test_a_drained_learner_says_how_much_was_merged_and_how_much_overwritten():
    from diloco_cli.launch.scale import DrainOutcome
    from diloco_cli.views.scale import render_drained, render_unfinished

    outcome = DrainOutcome(LearnerId("local-a-2"), 301_056, merged=(202_752, 243_712), overwritten=(98_304, 57_344))
    assert outcome.done and outcome.accounted == 301_056
    assert render_drained(outcome) == (
        "  local-a-2        drained: it stopped, and every one of the 301,056 tokens it trained is accounted for "
        "(fragment 0: 202,752 merged, 98,304 overwritten by installs; fragment 1: 243,712 merged, 57,344 overwritten "
        "by installs)"
    )
    stale = DrainOutcome(
        LearnerId("local-a-2"), 301_056, merged=(200_000, 243_712), overwritten=(98_304, 57_344), unanchored=(2752, 0)
    )
    assert stale.done and stale.accounted == 301_056
    assert "fragment 0: 200,000 merged, 98,304 overwritten by installs, 2,752 refused as too stale to anchor;" in (
        render_drained(stale)
    )
    late = DrainOutcome(LearnerId("local-a-2"), 301_056, merged=(202_752, 0), overwritten=(98_304, 0))
    assert not late.done and render_unfinished("r", [late, DrainOutcome(LearnerId("x"), 0)], 60) == (
        "error: after 60 s, not drained yet: local-a-2 (0 of 301,056 tokens merged, overwritten or refused), "
        "x (not stopped yet); `diloco status r` shows them"
    )


def test_scaling_a_run_whose_syncer_is_down_is_refused_and_changes_nothing(tmp_path):
    """The syncer carries a scale out (it tells drained learners to leave, merges new
    ones): with it down, the change would wait unsaid until ``resume``."""
    import json

    from click.testing import CliRunner

    from diloco_cli.cli.app import app
    from diloco_cli.launch.runs import load_run
    from tests.support.runs_on_disk import make_run, syncer_status

    runs_dir, spec = make_run(tmp_path)
    syncer_status(spec)  # its last report, a moment ago, says running
    record = json.loads((runs_dir / "viewed" / "run.json").read_text())
    record["processes"] = [{"name": "syncer", "kind": "syncer", "pid": 999999999, "host": "local"}]
    (runs_dir / "viewed" / "run.json").write_text(json.dumps(record))
    (runs_dir / "viewed" / "processes" / "syncer.json").write_text(json.dumps({"state": "running", "restarts": 0}))
    refused = CliRunner().invoke(
        app, ["scale", "viewed", "--region", "local-a", "--learners", "-1", "--runs-dir", str(runs_dir)]
    )
    assert refused.exit_code == 2 and refused.stderr == (
        "error: the syncer of run viewed is down (its supervisor is gone), and it is the one that carries a scale "
        "out; `diloco resume viewed` starts it again, then scale the run\n"
    )
    after = load_run(runs_dir, "viewed").spec
    assert not after.scaling and not any(learner.drain for learner in after.learners)
    assert spec.bucket("local-a", None).store.get("manifest.json").decode() == spec.to_json()  # untouched
