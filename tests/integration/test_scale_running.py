"""``diloco scale`` on a running run: a learner added starts from the global weights with a
slice of the data of its own, then drained, it sends what it trained and stops; the
syncer's M follows; the run's record and ``status`` keep the changes."""

import json
import time

import pytest

from diloco_cli.launch.runs import load_run
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
    assert "east-1           drained: it stopped, and every one of the" in drained.stdout
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
