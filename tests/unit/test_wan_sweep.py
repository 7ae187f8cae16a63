"""bench.wan's settings sweep, counted at equal loss: each data-parallel baseline's WAN
bytes to the setting's final loss over the setting's whole run (figures computed by hand)."""

import pytest

import bench.wan_sweep
from bench.wan_sweep import LABELS, replanned, summarize_sweep, sweep

REFERENCE = {
    "evaluations": [{"step": step, "loss": 3.0 - step / 100} for step in range(0, 301, 10)],  # 3.0 .. 0.0
    "final_loss": 0.0,
    "tokens_per_step": 1000,
    "wan_bytes_per_step": {"flat_ring": 3000.0, "hierarchical": 2000.0},
}


def row(setting, final_loss, wan_bytes, tokens=300_000):
    return {"setting": setting, "final_loss": final_loss, "wan_bytes": wan_bytes, "tokens": tokens}


def test_a_setting_is_compared_with_the_steps_data_parallel_needs_to_reach_its_loss():
    summary = summarize_sweep([row("default", 2.0, 10_000.0), row("coarse", 2.5, 1_000.0)], REFERENCE)
    default, coarse = summary["rows"]
    # target 2.0 x 1.01 = 2.02: the first evaluation at or below it is step 100 (loss 2.0)
    assert default["equal_loss"]["dp_steps_to_target"] == 100
    assert default["equal_loss"]["flat_ring_over_diloco"] == pytest.approx(3000 * 100 / 10_000)
    assert default["equal_loss"]["hierarchical_over_diloco"] == pytest.approx(2000 * 100 / 10_000)
    # at equal tokens: 300 steps of data-parallel for the run's 300k tokens
    assert default["equal_loss"]["flat_ring_over_diloco_equal_tokens"] == pytest.approx(3000 * 300 / 10_000)
    # a worse loss is reached sooner: 2.525 -> step 50
    assert coarse["equal_loss"]["dp_steps_to_target"] == 50
    assert coarse["equal_loss"]["flat_ring_over_diloco"] == pytest.approx(3000 * 50 / 1_000)
    assert coarse["loss_vs_default"] == pytest.approx(0.25)
    assert summary["meeting"] == [] and "missed: the most at equal loss is 150x" in summary["verdict"]


def test_the_targets_need_both_baselines_and_a_failed_setting_counts_as_unmeasured():
    summary = summarize_sweep(
        [row("default", 2.0, 1_000.0), row("failed", None, None), row("lean", 2.0, 900.0)], REFERENCE
    )
    default, failed, lean = summary["rows"]
    assert failed["equal_loss"] is None and not failed["meets_target"]
    # 300x the flat ring and 200x the hierarchical one: 3000 x 100 / 1000 = 300, 2000 x 100 / 1000 = 200
    assert default["meets_target"] and lean["meets_target"]
    assert summary["meeting"] == ["default", "lean"]
    lean_only = summarize_sweep([row("default", 2.0, 1_001.0)], REFERENCE)
    assert not lean_only["rows"][0]["meets_target"]


def test_rerunning_some_settings_keeps_the_earlier_rows_of_the_others(monkeypatch, tmp_path):
    ran = []

    def fake_run(label, overrides, workdir, timeout, attempt=0):  # a whole diloco up, elsewhere
        ran.append(label)
        return row(label, 2.0, 500.0)

    monkeypatch.setattr(bench.wan_sweep, "sweep_run", fake_run)
    earlier = [row(label, 2.0, 1_000.0) for label in LABELS[:-1]] + [row("a setting since removed", 2.0, 1.0)]
    written = []
    summary = sweep(tmp_path, REFERENCE, 60.0, written.append, only=[LABELS[1], LABELS[-1]], earlier=earlier)
    assert ran == [LABELS[1], LABELS[-1]]
    assert [r["setting"] for r in summary["rows"]] == list(LABELS)  # in the sweep's order, the removed one gone
    assert [r["wan_bytes"] for r in summary["rows"]] == [500.0 if label in ran else 1_000.0 for label in LABELS]
    assert len(written) == 2 and summary["rows"][0]["loss_vs_default"] == 0.0


def test_the_plans_worst_row_decides_whether_it_is_within_the_targets():
    def planned(setting, percent, points):
        return {
            **row(setting, 2.0, 1_000.0),
            "plan_vs_measured": {"wan_bytes": {"percent": percent}, "compute_share": {"points": points}},
        }

    rows = [planned("a", 4.0, -2.0), planned("b", -9.5, 1.0), row("before", 2.0, 1_000.0)]
    plan = summarize_sweep(rows, REFERENCE)["plan"]
    assert (plan["planned"], plan["unplanned"]) == (2, 1)
    assert plan["worst_wan_bytes_percent"] == -9.5 and plan["worst_wan_bytes_setting"] == "b"
    assert plan["worst_compute_share_points"] == -2.0 and plan["within_target"]
    assert not summarize_sweep([*rows, planned("c", 12.0, 0.0)], REFERENCE)["plan"]["within_target"]
    assert not summarize_sweep([*rows, planned("d", 0.0, 10.5)], REFERENCE)["plan"]["within_target"]
    assert summarize_sweep(rows[2:], REFERENCE)["plan"] == {"planned": 0, "unplanned": 1, "within_target": None}


def test_replanning_plans_the_rows_that_recorded_their_learners_again(monkeypatch):
    calls = []

    def fake_plan(overrides, learners, wan_bytes):
        calls.append((tuple(overrides), learners["median_learner_step_seconds"], wan_bytes))
        return {"wan_bytes": {"percent": 1.0}, "compute_share": {"points": -1.0}}

    monkeypatch.setattr(bench.wan_sweep, "plan_beside", fake_plan)
    measured = {**row("measured", 2.0, 1_000.0), "overrides": ["a=1"], "learners": {"median_learner_step_seconds": 0.4}}
    summary = replanned([row("before", 2.0, 1_000.0), measured], REFERENCE)
    assert calls == [(("a=1",), 0.4, 1_000.0)]
    assert summary["plan"]["planned"] == 1 and summary["rows"][1]["plan_commit"]
