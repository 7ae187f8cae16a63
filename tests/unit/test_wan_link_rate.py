"""bench.wan's link-rate figures (bench/wan_link_rate.py), against hand calculations."""

import pytest

from bench.wan_link_rate import dp_rate_for_target, summarize


def test_data_parallel_needs_the_rate_at_which_it_communicates_a_ninth_of_its_compute():
    # on 2 Mbit/s a step computes 0.3 s and communicates 9 s: 30x; a ninth of compute is 0.0333 s, 270x faster
    measured = {"medians": {"compute_seconds": 0.3, "comm_seconds": 9.0}}
    assert dp_rate_for_target(measured, 2.0) == pytest.approx(2.0 * 9.0 / (0.3 / 9))
    assert dp_rate_for_target(measured, 2.0, target=0.5) == pytest.approx(2.0 * 9.0 / 0.3)


def test_the_summary_says_whether_the_shaped_runs_confirm_the_plans_rate():
    plan = {"target_compute_share": 0.9, "diloco_mbit": 0.5, "flat_ring_mbit": 180.0, "hierarchical_mbit": None}
    runs = [
        {"factor": 1.0, "link_mbit": 0.5, "reaches_target": True},
        {"factor": 0.5, "link_mbit": 0.25, "reaches_target": False},
    ]
    summary = summarize(plan, {"flat_ring": 150.0, "hierarchical": 100.0}, runs)
    assert summary["diloco_confirmed_at_rate"] and summary["diloco_falls_short_below"]
    assert summary["measured_ratios"] == {"flat_ring": pytest.approx(300.0), "hierarchical": pytest.approx(200.0)}
    assert summary["dp_plan_vs_measured"] == {"flat_ring": pytest.approx(0.2), "hierarchical": None}
    unchecked = summarize(plan, {"flat_ring": 150.0, "hierarchical": 100.0}, [])
    assert not unchecked["diloco_confirmed_at_rate"] and not unchecked["diloco_falls_short_below"]
