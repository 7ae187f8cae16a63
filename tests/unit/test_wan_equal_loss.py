"""bench.wan's rule at data-parallel's own final loss (bench/wan_equal_loss.py), on made-up
curves: the target, each side's tokens to it, DiLoCo's runs (the budget's, then the
longer schedule's), the baselines' bytes and time, the token overhead and the floor.
Every expected figure is worked out by hand in the comments."""

from pathlib import Path

import pytest

from bench.wan_equal_loss import (
    TARGET_SOURCE,
    baseline,
    diloco_to_target,
    dp_steps_to_target,
    equal_loss,
    target_loss,
)

REPOSITORY = Path(__file__).resolve().parents[2]
DP = [{"step": 0, "loss": 5.0}, {"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.4}]


def evaluation(version, tokens, loss, time):
    return {"version": version, "tokens": tokens, "loss": loss, "time": time}


BUDGET = {  # launched at 95, never below 2.4: ends at 2.6
    "launched": 95.0,
    "evaluations": [evaluation(0, 0, 5.0, 100.0), evaluation(1, 1000, 3.0, 110.0), evaluation(2, 2000, 2.6, 120.0)],
    "wan_bytes": 4000,
    "wire_wan_bytes": 4400,
    "stopped_at_target": False,
}
LONGER = {  # launched at 190, below 2.4 at its fourth evaluation, stopped there
    "launched": 190.0,
    "evaluations": [
        evaluation(0, 0, 5.0, 200.0),
        evaluation(1, 1000, 3.2, 210.0),
        evaluation(2, 2000, 2.8, 220.0),
        evaluation(3, 3000, 2.2, 230.0),
    ],
    "wan_bytes": 5000,
    "wire_wan_bytes": 6000,
    "stopped_at_target": True,
}


def test_the_target_is_data_parallels_final_evaluation_which_it_reaches_at_its_last_step():
    assert target_loss(DP) == 2.4
    # 2.4 first at step 30: 20 + 10 x (2.5 - 2.4) / (2.5 - 2.4) = 30
    assert dp_steps_to_target(DP, target_loss(DP)) == pytest.approx(30.0)


def test_data_parallel_reaches_its_final_loss_earlier_where_its_curve_dips_below_it_before():
    dipping = [*DP[:2], {"step": 20, "loss": 2.3}, {"step": 30, "loss": 2.4}]
    # straddled by (10, 3.0) and (20, 2.3): 10 + 10 x (3.0 - 2.4) / (3.0 - 2.3) = 18.571...
    assert dp_steps_to_target(dipping, target_loss(dipping)) == pytest.approx(10 + 10 * 0.6 / 0.7)
    assert dp_steps_to_target(DP, 2.0) is None


def test_diloco_reaches_the_target_on_the_longer_schedule_when_the_budget_does_not():
    reached = diloco_to_target({"budget": BUDGET, "2x the budget": LONGER}, 2.4)
    assert reached["reached"] and reached["schedule"] == "2x the budget"
    # straddled by (2000, 2.8) and (3000, 2.2): 2000 + 1000 x 0.4 / 0.6 = 2666.67 tokens
    assert reached["tokens_to_target"] == pytest.approx(2000 + 1000 * 0.4 / 0.6)
    assert reached["version_at_target"] == 3 and reached["time_to_target_seconds"] == 230.0 - 190.0
    # the run stopped at the target: its bytes are the bytes to the target
    assert (reached["wan_bytes_to_target"], reached["wire_wan_bytes_to_target"]) == (5000, 6000)
    assert reached["bytes_counted"].startswith("to the target")


def test_a_budget_run_that_reaches_the_target_before_its_end_counts_its_whole_run():
    reached = diloco_to_target({"budget": BUDGET, "2x the budget": None}, 2.8)
    # 2.6 at 2000 tokens is the first at or below 2.8: 1000 + 1000 x (3.0 - 2.8) / (3.0 - 2.6) = 1500
    assert reached["schedule"] == "budget" and reached["tokens_to_target"] == pytest.approx(1500.0)
    assert reached["time_to_target_seconds"] == 120.0 - 95.0 and reached["version_at_target"] == 2
    # reached at its last evaluation: the whole run is the run to the target
    assert reached["bytes_counted"].startswith("to the target")
    earlier = diloco_to_target({"budget": BUDGET}, 3.0)
    assert earlier["version_at_target"] == 1 and earlier["wan_bytes_to_target"] == 4000
    assert earlier["bytes_counted"].startswith("the whole run")


def test_a_run_that_never_reaches_the_target_has_no_figures_to_it():
    reached = diloco_to_target({"budget": BUDGET, "2x the budget": LONGER}, 2.0)
    assert not reached["reached"]
    assert reached["tokens_to_target"] is None and reached["wan_bytes_to_target"] is None
    assert reached["tokens_without_reaching"] == 3000  # the longer run's last evaluation: the most it trained


def measured(all_reduce, per_step, wire_per_step, step_seconds):
    return {
        "all_reduce": all_reduce,
        "app_wan_bytes_per_step": per_step,
        "wire_wan_bytes_per_step": wire_per_step,
        "medians": {"step_seconds": step_seconds},
    }


def dp_side(steps=30.0, tokens_per_step=50):
    return {
        "target": 2.4,
        "steps_to_target": steps,
        "tokens_per_step": tokens_per_step,
        "baselines": {
            "flat_ring": baseline(measured("ring", 1000, 1100, 2.0), steps, tokens_per_step),
            "hierarchical": baseline(measured("hierarchical", 500, 550, 1.0), steps, tokens_per_step),
        },
    }


def test_both_sides_at_data_parallels_final_loss():
    dp = dp_side()
    # flat ring: 1000 B x 30 steps = 30,000 B (wire 33,000) in 2 s x 30 = 60 s; hierarchical 15,000 B in 30 s
    assert dp["baselines"]["flat_ring"]["wan_bytes_to_target"] == 30_000
    assert dp["baselines"]["hierarchical"]["time_to_target_seconds"] == 30.0
    reached = diloco_to_target({"budget": BUDGET, "2x the budget": LONGER}, 2.4)
    equal = equal_loss(dp, reached, diloco_final=2.6, floor_final=2.7)
    assert equal["target_source"] == TARGET_SOURCE == "data-parallel's final loss" and equal["target"] == 2.4
    # data-parallel: 30 steps x 50 tokens = 1500 tokens; DiLoCo 2666.67: 1.778x
    assert equal["dp_tokens_to_target"] == 1500
    assert equal["diloco_token_overhead"] == pytest.approx((2000 + 1000 * 0.4 / 0.6) / 1500)
    assert equal["wan_bytes_flat_ring_over_diloco"] == pytest.approx(30_000 / 5000)
    assert equal["wire_wan_bytes_flat_ring_over_diloco"] == pytest.approx(33_000 / 6000)
    assert equal["time_to_target_flat_ring_over_diloco"] == pytest.approx(60 / 40)
    assert equal["wan_bytes_hierarchical_over_diloco"] == pytest.approx(15_000 / 5000)
    assert equal["time_to_target_hierarchical_over_diloco"] == pytest.approx(30 / 40)
    assert equal["diloco_beats_floor"] and equal["diloco_bytes_counted"].startswith("to the target")


def test_a_run_not_below_the_floor_fails_and_one_that_never_reaches_the_target_has_no_ratios():
    reached = diloco_to_target({"budget": BUDGET}, 2.4)
    equal = equal_loss(dp_side(), reached, diloco_final=2.6, floor_final=2.6)
    assert not equal["diloco_beats_floor"]  # equal to the floor is not below it
    assert not equal["diloco_reached"] and equal["diloco_token_overhead"] is None
    # it trained 2000 tokens without reaching 2.4; data-parallel needs 30 steps x 50 = 1500
    assert equal["diloco_token_overhead_above"] == pytest.approx(2000 / 1500)
    assert equal["wan_bytes_flat_ring_over_diloco"] is None and equal["time_to_target_hierarchical_over_diloco"] is None
    assert "never reached" in equal["rule"]


def quality_result(dp_batch=32):
    """A made-up bench.quality result: two data-parallel seeds, one floor seed."""
    setting = {"dp_batch": dp_batch, "dp_learning_rate": 6e-3}
    model = {
        "factory": "diloco_cli.models.gpt:byte_gpt",
        "kwargs": {"num_layers": 4, "width": 128, "num_heads": 4, "context": 128},
    }

    def row(name, seed, evaluations):
        return {"row": name, "seed": seed, "setting": setting, "tokens": 16_850_944, "evaluations": evaluations}

    return {
        "settings": {"model": model, "sequence_length": 128},
        "results": {
            "rows": [
                row("data-parallel", 0, [[4096, 3.0], [8192, 2.0], [16_850_944, 1.4]]),
                row("floor: one learner alone", 0, [[1024, 3.5], [4_212_736, 1.7]]),
                row("data-parallel", 1, [[2048, 3.2], [8192, 2.2], [16_850_944, 1.6]]),  # other points: interpolated
                row("DiLoCo M=4 K=M", 0, [[16_850_944, 1.3]]),
            ]
        },
    }


def test_a_quality_results_data_parallel_seeds_give_the_target_curve_by_step_and_its_floor_the_floor():
    from bench.wan_equal_loss import quality_reference
    from diloco_cli.config.files import load_recipe

    recipe = load_recipe(REPOSITORY / "recipes" / "compute-optimal.yaml")  # 4 x 8 sequences of 128: 4096 per step
    reference = quality_reference(quality_result(), "q.json", recipe)
    # seed 1 at 4096 tokens: 3.2 + (2.2 - 3.2) x (4096 - 2048) / (8192 - 2048) = 2.8666...; the mean with 3.0
    assert [e["step"] for e in reference["evaluations"]] == [1, 2, 4114]
    assert [e["loss"] for e in reference["evaluations"]] == pytest.approx([(3.0 + 3.2 - 1 / 3) / 2, 2.1, 1.5])
    assert target_loss(reference["evaluations"]) == pytest.approx(1.5)  # the seeds' mean final loss
    assert reference["floor"]["final_loss"] == 1.7 and reference["dp_seeds"] == [0, 1]
    assert (
        reference["floor"]["learners_share"] == "1/4" and "floor row, seeds [0], in q.json" in reference["floor"]["how"]
    )
    with pytest.raises(SystemExit, match=r"q.json: .*global batch 64 there, 32 here.*--recipe"):
        quality_reference(quality_result(dp_batch=64), "q.json", recipe)
    with pytest.raises(SystemExit, match=r"global batch 32 there, 64 here; tokens 16,850,944 there, 2,457,600 here"):
        quality_reference(
            quality_result(), "q.json", load_recipe(None)
        )  # the default recipe: 300 steps x 4 x 16 sequences x 128


def test_a_recipe_file_as_overrides_of_the_default_recipe_is_the_recipe():
    from bench.wan_options import recipe_overrides
    from diloco_cli.config.files import load_recipe

    for name in ("compute-optimal.yaml", "wan.yaml"):
        path = REPOSITORY / "recipes" / name
        overrides = recipe_overrides(path)
        assert load_recipe(None, overrides) == load_recipe(path), name
        assert load_recipe(None, overrides) != load_recipe(None)
