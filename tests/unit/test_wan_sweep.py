"""bench.wan's settings sweep, counted to data-parallel's own final loss: whether and when
each setting reached it, and each data-parallel baseline's WAN bytes to it over the
setting's whole run (figures computed by hand)."""

import pytest

import bench.wan_sweep
from bench.wan_sweep import LABELS, replanned, summarize_sweep, sweep

REFERENCE = {  # 3.0 at step 0, down 0.01 a step to 1.0 at step 200, flat after: its final loss is 1.0
    "evaluations": [{"step": step, "loss": max(1.0, 3.0 - step / 100)} for step in range(0, 301, 10)],
    "final_loss": 1.0,
    "tokens_per_step": 1000,
    "wan_bytes_per_step": {"flat_ring": 3000.0, "hierarchical": 2000.0},
}


def row(setting, final_loss, wan_bytes, tokens=300_000, evaluations=None):
    """A sweep row; without ``evaluations``, one from before the sweep kept them."""
    kept = {"evaluations": evaluations, "launched": 5.0} if evaluations else {}
    return {"setting": setting, "final_loss": final_loss, "wan_bytes": wan_bytes, "tokens": tokens, **kept}


def curve(*points):
    return [{"tokens": tokens, "loss": loss, "time": time} for tokens, loss, time in points]


def test_a_setting_is_counted_to_the_steps_data_parallel_needs_to_reach_its_own_final_loss():
    default = row("default", 0.9, 10_000.0, evaluations=curve((0, 3.0, 10), (150_000, 1.5, 20), (300_000, 0.9, 30)))
    coarse = row("coarse", 1.8, 1_000.0, evaluations=curve((0, 3.0, 10), (300_000, 1.8, 30)))
    summary = summarize_sweep([default, coarse], REFERENCE)
    default, coarse = summary["rows"]
    equal = default["equal_loss"]
    # the target is data-parallel's final 1.0, first reached at step 200 (1.01 at 190, 1.0 at 200)
    assert equal["target_loss"] == 1.0 and equal["target_source"] == "data-parallel's final loss"
    assert equal["dp_steps_to_target"] == pytest.approx(200)
    assert equal["flat_ring_over_diloco"] == pytest.approx(3000 * 200 / 10_000)
    assert equal["hierarchical_over_diloco"] == pytest.approx(2000 * 200 / 10_000)
    # at equal tokens: 300 steps of data-parallel for the run's 300k tokens
    assert equal["flat_ring_over_diloco_equal_tokens"] == pytest.approx(3000 * 300 / 10_000)
    # reached between (150k, 1.5) and (300k, 0.9): 150k + 150k x 0.5 / 0.6 = 275k tokens, 1.375x
    # data-parallel's 200 x 1000; at the evaluation of 30 s, 25 s after the launch at 5
    assert equal["reached"] and equal["tokens_to_target"] == pytest.approx(275_000)
    assert equal["token_overhead"] == pytest.approx(275_000 / 200_000) and equal["seconds_to_target"] == 25.0
    # a setting that never reaches it is not counted to a loss of its own: same steps, no target met
    assert not coarse["equal_loss"]["reached"] and coarse["equal_loss"]["tokens_to_target"] is None
    assert coarse["equal_loss"]["flat_ring_over_diloco"] == pytest.approx(3000 * 200 / 1_000)
    assert coarse["loss_vs_default"] == pytest.approx(1.8 / 0.9 - 1) and not coarse["meets_target"]
    # the verdict names the best setting that reached the loss, not the one with the larger ratio
    assert summary["meeting"] == [] and "missed: the most to data-parallel's final loss is 60x" in summary["verdict"]


def test_the_targets_need_both_baselines_and_the_loss_and_a_failed_setting_counts_as_unmeasured():
    summary = summarize_sweep(
        [row("default", 1.0, 2_000.0), row("failed", None, None), row("lean", 0.95, 1_900.0)], REFERENCE
    )
    default, failed, lean = summary["rows"]
    assert failed["equal_loss"] is None and not failed["meets_target"]
    # 300x the flat ring and 200x the hierarchical one: 3000 x 200 / 2000 = 300, 2000 x 200 / 2000 = 200;
    # rows from before evaluations were kept: reached from the final loss, no tokens
    assert default["meets_target"] and lean["meets_target"] and default["equal_loss"]["tokens_to_target"] is None
    assert summary["meeting"] == ["default", "lean"]
    assert not summarize_sweep([row("default", 1.0, 2_001.0)], REFERENCE)["rows"][0]["meets_target"]
    above = summarize_sweep([row("above", 1.01, 100.0)], REFERENCE)["rows"][0]
    assert above["equal_loss"]["flat_ring_over_diloco"] == pytest.approx(6000) and not above["meets_target"]


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
