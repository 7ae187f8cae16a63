"""The quality benchmark's arithmetic on made-up curves: gaps to data-parallel's final
loss, the spread over seeds, tokens to reach a loss, the floor, and the targets' rule
(a gap within the seed-to-seed spread counts as met up to twice the spread)."""

import math
from dataclasses import asdict, replace

import pytest

from bench.quality_runs import loss_at, tokens_to_reach
from bench.quality_summary import DATA_PARALLEL, EXTENDED, FLOOR, Rows, summarize, targets_of

NAMES = Rows(4, quick=False)


def row(label, seed, curve, **extra):
    tokens = curve[-1][0]
    losses = {f"loss_{f}": loss_at(curve, f * tokens) for f in (0.25, 0.5, 1.0)}
    return {"row": label, "seed": seed, "tokens": tokens, "seconds": 10.0, "evaluations": curve, **losses, **extra}


def test_tokens_to_reach_and_loss_at_interpolate_between_the_evaluations_that_straddle_them():
    curve = [[100, 3.0], [200, 2.0], [300, 1.5]]
    assert tokens_to_reach(curve, 2.5) == pytest.approx(150)
    assert tokens_to_reach(curve, 3.0) == 100
    assert tokens_to_reach(curve, 1.4) is None
    assert loss_at(curve, 150) == pytest.approx(2.5)  # linear between the evaluations that straddle it
    assert loss_at(curve, 200) == 2.0 and loss_at(curve, 50) == 3.0 and loss_at(curve, 400) == 1.5


def test_gaps_spread_overhead_and_floor_are_read_against_data_parallels_final_loss():
    rows = [
        row(DATA_PARALLEL, 0, [[100, 3.0], [200, 2.1], [400, 2.0]]),
        row(DATA_PARALLEL, 1, [[100, 3.0], [200, 2.1], [400, 2.2]]),  # mean final loss 2.1
        row(FLOOR, 0, [[50, 3.0], [100, 2.5]]),
        row(NAMES.sync, 0, [[100, 3.0], [200, 2.5], [400, 2.2], [800, 2.0]]),
        row(NAMES.decoupled, 0, [[100, 3.0], [400, 2.6]]),
        row(NAMES.tokens, 0, [[100, 4.0], [400, 3.0]], bytes_per_token=2.0),
    ]
    summary = summarize(rows, NAMES)
    dp = summary[DATA_PARALLEL]
    assert dp["loss_1.0"] == pytest.approx(2.1) and dp["spread"] == pytest.approx(0.2 / 2.1)
    sync = summary[NAMES.sync]
    assert sync["gap_vs_dp"] == pytest.approx(2.0 / 2.1 - 1)
    assert sync["tokens_to_dp_loss"] == pytest.approx(400 + 400 * (2.2 - 2.1) / (2.2 - 2.0))  # 600
    assert sync["token_overhead"] == pytest.approx(600 / 400)
    assert sync["beats_floor"] and not summary[NAMES.decoupled]["beats_floor"]
    assert summary[NAMES.decoupled]["tokens_to_dp_loss"] is None
    assert summary[NAMES.tokens]["bpb_1.0"] == pytest.approx(3.0 / math.log(2) / 2.0)
    assert "gap_vs_dp" not in summary[NAMES.tokens]  # nats per token do not compare with per byte
    targets = targets_of(summary, NAMES)
    assert targets["every row beats the floor"] == {
        "target": "loss below the floor's",
        "failing": [NAMES.decoupled],
        "met": False,
    }
    assert targets[f"{NAMES.sync} vs data-parallel"]["met"]  # ahead of it
    assert targets[f"{NAMES.sync} vs data-parallel"]["met_by"] == "the target"
    assert not targets[f"{NAMES.sync} vs data-parallel"]["seeds_due"]
    decoupled = targets[f"{NAMES.decoupled} vs {NAMES.sync}"]
    assert decoupled["measured"] == pytest.approx(0.3) and not decoupled["met"]


def test_a_gap_within_twice_the_seed_spread_counts_as_met_and_a_longer_run_gives_the_overhead():
    rows = [
        row(DATA_PARALLEL, 0, [[400, 2.00]]),
        row(DATA_PARALLEL, 1, [[400, 2.04]]),  # spread 2%
        row(NAMES.sync, 0, [[400, 2.10]]),  # 3.96% behind: over 3%, within twice the spread
        row(NAMES.sync + EXTENDED, 0, [[400, 2.2], [600, 2.02], [800, 1.95]]),
    ]
    summary = summarize(rows, NAMES)
    target = targets_of(summary, NAMES)[f"{NAMES.sync} vs data-parallel"]
    assert target["measured"] == pytest.approx(2.10 / 2.02 - 1) and target["met"]
    assert target["spread"] == pytest.approx(0.04 / 2.02)
    assert target["met_by"] == "twice the spread" and target["seeds"] == 1 and target["seeds_due"]
    assert summary[NAMES.sync]["tokens_to_dp_loss"] == pytest.approx(600)
    assert summary[NAMES.sync]["tokens_to_dp_loss_from"] == NAMES.sync + EXTENDED
    rows[3] = row(NAMES.sync, 1, [[400, 2.30]])  # a second seed far apart widens the spread
    assert targets_of(summarize(rows[:4], NAMES), NAMES)[f"{NAMES.sync} vs data-parallel"]["met"]


def quality_sitting(tmp_path, rows=""):
    from bench.quality import Quality, parse_args

    return Quality(parse_args(["--rows", rows] if rows else []), tmp_path)


def test_the_full_form_is_20_tokens_per_parameter_and_runs_the_most_informative_rows_first(tmp_path):
    sitting = quality_sitting(tmp_path)
    parameters = sum(p.numel() for p in sitting.base.model.build().parameters())
    assert sitting.budget == 20 * parameters
    plan = sitting.plan([], {})
    assert plan[:4] == [(DATA_PARALLEL, 0), (FLOOR, 0), (NAMES.sync, 0), (NAMES.decoupled, 0)]
    assert {label for label, _ in plan} == {
        DATA_PARALLEL,
        FLOOR,
        NAMES.decoupled,
        NAMES.wan,
        NAMES.tokens,
        *map(NAMES.of_size, (1, 2, 4, 8)),
    }
    assert not any(label.endswith(EXTENDED) for label, _ in plan)  # nothing measured yet
    done = [{"row": label, "seed": seed} for label, seed in plan]
    behind = {DATA_PARALLEL: {"loss_1.0": 1.5}, NAMES.sync: {"loss_1.0": 1.6}, NAMES.decoupled: {"loss_1.0": 1.4}}
    assert sitting.plan(done, behind) == [(NAMES.sync + EXTENDED, 0)]  # only the row behind data-parallel


def test_rows_are_chosen_by_name_and_an_unknown_name_is_refused_with_the_names(tmp_path):
    assert {label for label, _ in quality_sitting(tmp_path, "data-parallel").plan([], {})} == {DATA_PARALLEL}
    chosen = quality_sitting(tmp_path, f"{DATA_PARALLEL}; {NAMES.wan}").plan([], {})
    assert {label for label, _ in chosen} == {DATA_PARALLEL, NAMES.wan}  # a name that holds a comma
    with pytest.raises(SystemExit, match="no row named 'DiLoCo M=3 K=M'.*floor: one learner alone"):
        quality_sitting(tmp_path, "DiLoCo M=3 K=M").plan([], {})


TUNED = dict(
    dp_learning_rate=6e-3,
    dp_batch=32,
    inner_learning_rate=6e-3,
    outer_learning_rate=1.0,
    outer_momentum=0.0,
    sync_interval=25,
    batch_per_learner=8,
    install="keep-unsent",
)
BETA2, WARMUP, OUTER, SCHEDULE = (
    "AdamW beta2 0.99",
    "warmup 5% of the steps",
    "outer lr 1.4 (the anchors' rises with M)",
    "H/4 then H/2 over the first tenth",
)


def lever(name, loss, setting=TUNED):
    return {"lever": name, "setting": setting, "loss": loss}


def test_the_rows_take_the_levers_that_beat_the_tuned_run_by_more_than_one_percent_together_if_that_is_better():
    from bench.quality import chosen_levers
    from bench.quality_tuning import Setting

    tuned = Setting.of(TUNED)
    levers = [lever("tuned", 2.0), lever(BETA2, 1.99), lever(OUTER, 1.95), lever(SCHEDULE, 1.90)]
    assert chosen_levers(levers[:2], tuned) == ()  # 0.5%: within two runs' difference
    assert chosen_levers(levers, tuned) == (SCHEDULE,)  # the best alone until both were measured together
    together = " + ".join(sorted([OUTER, SCHEDULE]))
    assert chosen_levers([*levers, lever(together, 1.85)], tuned) == tuple(sorted([OUTER, SCHEDULE]))
    assert chosen_levers([*levers, lever(together, 1.92)], tuned) == (SCHEDULE,)
    elsewhere = {**TUNED, "sync_interval": 50}  # measured at another tuned setting: not evidence here
    assert chosen_levers([lever("tuned", 2.0, elsewhere), lever(SCHEDULE, 1.5, elsewhere)], tuned) == ()


def test_a_lever_changes_the_setting_or_adds_recipe_sections_and_the_k_below_m_rows_scale_its_outer_step():
    from dataclasses import replace

    from bench.quality import base_recipe, diloco_recipe, lever_changes
    from bench.quality_tuning import Setting

    tuned, base = Setting.of(TUNED), base_recipe(quick=False)
    changed, sections = lever_changes((OUTER, SCHEDULE), tuned, 1000)
    assert changed.outer_learning_rate == pytest.approx(1.4) and changed.sync_interval == 25
    assert sections == {"sync": {"sync_interval_schedule": [[50, 6], [100, 12]]}}
    setting = replace(changed, levers=(OUTER, SCHEDULE))
    m4 = diloco_recipe(base, setting, 0, 4 * 1000 * 8 * 128, 4)
    assert m4.sync.sync_interval_schedule == ((50, 6), (100, 12))
    assert m4.sync.outer_learning_rate == pytest.approx(1.4)  # applied once, at the choice
    k1 = diloco_recipe(base, setting, 0, 4 * 1000 * 8 * 128, 4, quorum=1)
    assert k1.sync.outer_learning_rate == pytest.approx(1.4 * 0.5)  # sqrt(K/M) as for the tuned one
    beta2 = diloco_recipe(base, replace(tuned, levers=(BETA2,)), 0, 4 * 1000 * 8 * 128, 4)
    assert tuple(beta2.training.betas) == (0.9, 0.99)


def test_resuming_supersedes_only_the_rows_whose_own_settings_the_levers_changed():
    from bench.quality import lever_changes, stale_rows
    from bench.quality_tuning import Setting

    tuned = Setting.of(TUNED)
    rows = [{"row": label, "setting": TUNED} for label in (DATA_PARALLEL, FLOOR, NAMES.sync)]
    assert stale_rows(rows, tuned) == []  # a result file from before there were levers
    sync_only = replace(tuned, outer_learning_rate=1.4, levers=(OUTER,))
    assert stale_rows(rows, sync_only) == rows[2:]  # data-parallel and the floor do not sync
    assert stale_rows([{"row": NAMES.sync, "setting": asdict(sync_only)}], sync_only) == []
    assert stale_rows(rows, replace(tuned, levers=(BETA2,))) == rows  # the inner optimizer is everyone's
    both = "inner and data-parallel lr halved (both tuned at an eighth of the budget)"
    rates, _ = lever_changes((both,), tuned, 1000)
    assert (rates.dp_learning_rate, rates.inner_learning_rate) == (
        tuned.dp_learning_rate / 2,
        tuned.inner_learning_rate / 2,
    )
    assert stale_rows(rows, replace(rates, levers=(both,))) == rows  # data-parallel retuned with DiLoCo
    polls = "polls 5x as often (learners every 0.2 s, the syncer and reducers every 0.15 s)"
    assert stale_rows(rows, replace(tuned, levers=(polls,))) == rows[2:]  # a learner's polls: only DiLoCo's


def test_the_install_lag_of_a_row_is_its_median_learners_averaged_over_seeds():
    lags = [{"a": 4.0, "b": 6.0, "c": 20.0, "d": None}, {"a": 3.0, "b": 5.0}]
    rows = [row(NAMES.sync, seed, [[400, 2.0]], install_lag_steps=lag) for seed, lag in enumerate(lags)]
    assert summarize(rows, NAMES)[NAMES.sync]["install_lag_steps"] == pytest.approx((6.0 + 4.0) / 2)
    rows[1]["install_lag_steps"] = {"a": None}  # a run none of whose learners installed after a send
    assert "install_lag_steps" not in summarize(rows, NAMES)[NAMES.sync]


def test_a_row_not_rerun_at_the_chosen_setting_is_shown_as_last_measured_and_marked():
    """A sitting that adopts a lever and reruns one row keeps the others in the summary
    from their newest superseded runs, marked, and a target read across settings says so."""
    from bench.quality_summary import EARLIER

    old, older, new = {"levers": []}, {"levers": ["x"]}, {"levers": ["polls"]}
    rows = [
        row(DATA_PARALLEL, 0, [[400, 2.0]], setting=new),
        row(NAMES.sync, 0, [[400, 2.04]], setting=new),
    ]
    superseded = [
        row(NAMES.sync, 0, [[400, 2.10]], setting=old),
        row(NAMES.decoupled, 0, [[400, 2.50]], setting=older),  # an older generation of the row
        row(NAMES.decoupled, 0, [[400, 2.06]], setting=old),
        row(NAMES.decoupled, 1, [[400, 2.08]], setting=old),
    ]
    summary = summarize(rows, NAMES, superseded)
    assert summary[NAMES.sync]["loss_1.0"] == pytest.approx(2.04) and "measured_at" not in summary[NAMES.sync]
    assert summary[NAMES.decoupled]["loss_1.0"] == pytest.approx(2.07)  # the newest generation alone
    assert summary[NAMES.decoupled]["seeds"] == [0, 1] and summary[NAMES.decoupled]["measured_at"] == EARLIER
    target = targets_of(summary, NAMES)[f"{NAMES.decoupled} vs {NAMES.sync}"]
    assert target["measured_at_an_earlier_setting"] == [NAMES.decoupled]
    assert "measured_at_an_earlier_setting" not in targets_of(summary, NAMES)[f"{NAMES.sync} vs data-parallel"]
    longer = row(NAMES.sync + EXTENDED, 0, [[400, 2.1], [800, 1.9]], setting=old)  # reaches 2.0, not rerun
    summary = summarize(rows, NAMES, [*superseded, longer])
    assert summary[NAMES.sync]["tokens_to_dp_loss"] == pytest.approx(600)
    assert summary[NAMES.sync]["tokens_to_dp_loss_from"] == f"{NAMES.sync}{EXTENDED}, measured at {EARLIER}"


def test_adopt_names_levers_and_refuses_an_unknown_one_with_the_names():
    from bench.quality import adopted
    from bench.quality_levers import lever_of

    assert adopted(f"{SCHEDULE}; {BETA2}") == (BETA2, SCHEDULE) and adopted("") == ()
    assert adopted(f"{BETA2}, run 2") == (f"{BETA2}, run 2",) and lever_of(f"{BETA2}, run 2") == BETA2
    with pytest.raises(SystemExit, match="no lever named 'momentum'"):
        adopted("momentum, run 2")
    with pytest.raises(SystemExit, match="no lever named 'momentum'.*AdamW beta2 0.99"):
        adopted("momentum")


def test_a_yardstick_named_with_levers_runs_the_setting_and_training_sections_they_make():
    """``LOCKSTEP + LEVER``: the lockstep with the lever's outer step (and the recipe
    sections it adds); a lever alone is the product's, and an unknown part is refused."""
    from bench.quality_levers import LOCKSTEP, LOCKSTEP_RDA, LOCKSTEPS, adopted, yardstick
    from bench.quality_tuning import Setting

    tuned = Setting(6e-3, 32, 6e-3, 1.0, 0.0, 25, 8, "keep-unsent")
    momentum = "outer momentum 0.6 at lr 0.4 (the same long-run step, tens of rounds in)"
    options, changed, sections = yardstick(f"{LOCKSTEP_RDA} + {momentum} + {BETA2}", tuned, 1000)
    assert options == LOCKSTEPS[LOCKSTEP_RDA] and options["merge"] == "rda"
    assert (changed.outer_learning_rate, changed.outer_momentum) == (0.4, 0.6)
    assert changed.levers == (momentum, BETA2) and sections["training"]["betas"][1] == 0.99
    assert yardstick(LOCKSTEP, tuned, 1000) == (LOCKSTEPS[LOCKSTEP], tuned, {})
    assert yardstick(momentum, tuned, 1000) is None
    assert adopted(f"{LOCKSTEP} + {momentum}", *LOCKSTEPS) == (f"{LOCKSTEP} + {momentum}",)
    with pytest.raises(SystemExit, match="no lever named 'momentum'"):
        adopted(f"{LOCKSTEP} + momentum", *LOCKSTEPS)


def test_the_levers_of_diloco_own_setting_change_the_inner_lr_h_or_batch_and_the_steps_follow_the_batch():
    """The levers tried at the full budget in the lockstep: each changes one field of the
    tuned setting, and a doubled batch per learner trains the same tokens in half the steps."""
    from bench.quality import base_recipe, diloco_recipe
    from bench.quality_levers import LOCKSTEP, yardstick
    from bench.quality_tuning import Setting

    tuned, base = Setting.of(TUNED), base_recipe(quick=False)
    changes = {
        "inner lr halved (tuned at an eighth of the budget, 8x fewer rounds)": {"inner_learning_rate": 3e-3},
        "H doubled (half the rounds, each twice as long)": {"sync_interval": 50},
        "batch per learner doubled (the anchors find DiLoCo's best batch larger)": {"batch_per_learner": 16},
    }
    for lever, fields in changes.items():
        _, changed, _ = yardstick(f"{LOCKSTEP} + {lever}", tuned, 1000)
        assert {k: v for k, v in vars(changed).items() if k != "levers" and getattr(tuned, k) != v} == fields
    doubled = yardstick(
        f"{LOCKSTEP} + batch per learner doubled (the anchors find DiLoCo's best batch larger)", tuned, 1
    )[1]
    tokens = 4 * 1000 * tuned.batch_per_learner * base.data.sequence_length
    assert diloco_recipe(base, doubled, 0, tokens, 4).training.inner_steps == 500
    assert diloco_recipe(base, tuned, 0, tokens, 4).training.inner_steps == 1000


def test_the_compute_optimal_recipe_is_what_bench_quality_tuned_and_trains_20_tokens_per_parameter(tmp_path):
    """recipes/compute-optimal.yaml serves the horizon bench.quality measures: its
    settings are those the result file's rows ran (tuned, with the levers chosen: the
    recipe sections they add are part of the measured recipe) and its budget the
    harness's."""
    import json
    from pathlib import Path

    from bench.quality import base_recipe, diloco_recipe
    from bench.quality_tuning import Setting
    from diloco_cli.config.loading import load_model
    from diloco_cli.config.recipe import Recipe

    root = Path(__file__).resolve().parents[2]
    results = json.loads((root / "bench" / "results" / "quality.json").read_text())
    tuned = Setting.of(results["results"]["tuned"])
    recipe = load_model(Recipe, root / "recipes" / "compute-optimal.yaml")
    base = base_recipe(quick=False)
    parameters = sum(p.numel() for p in base.model.build().parameters())
    measured = diloco_recipe(base, tuned, 0, 20 * parameters, 4)
    for section, keys in {
        "training": ("num_learners", "batch_size", "inner_steps", "learning_rate", "betas", "warmup_steps"),
        "sync": ("sync_interval", "sync_interval_schedule", "outer_momentum", "merge", "learner_codec", "update_codec"),
    }.items():
        for key in keys:
            assert getattr(getattr(recipe, section), key) == getattr(getattr(measured, section), key), key
    assert recipe.outer_learning_rate == measured.outer_learning_rate and recipe.keeps_unsent_work


def test_the_wan_recipe_is_the_rows_recipe_bench_quality_measures_it_by():
    """recipes/wan.yaml serves the same horizon: its training and merging are those of
    the harness's "Decoupled K=1 of 4, recipes/wan.yaml" row at the tuned setting."""
    import json
    from pathlib import Path

    from bench.quality import Quality, parse_args
    from bench.quality_tuning import Setting
    from diloco_cli.config.files import load_recipe

    root = Path(__file__).resolve().parents[2]
    results = json.loads((root / "bench" / "results" / "quality.json").read_text())
    tuned = Setting.of(results["results"]["tuned"])
    quality = Quality(parse_args([]), root)
    measured = quality.row_recipe(NAMES.wan, tuned, 0, quality.budget)
    recipe = load_recipe(root / "recipes" / "wan.yaml")
    for section, keys in {
        "training": ("num_learners", "batch_size", "inner_steps", "learning_rate", "betas", "warmup_steps"),
        "sync": (
            "quorum",
            "sync_interval",
            "num_fragments",
            "outer_momentum",
            "merge",
            "learner_codec",
            "update_codec",
        ),
    }.items():
        for key in keys:
            assert getattr(getattr(recipe, section), key) == getattr(getattr(measured, section), key), key
    assert recipe.outer_learning_rate == measured.outer_learning_rate == 0.5
    assert recipe.keeps_unsent_work == measured.keeps_unsent_work


def test_a_levers_verdict_at_a_longer_fraction_of_the_budget_replaces_its_shorter_one():
    from bench.quality import chosen_levers, lever_ratios
    from bench.quality_tuning import Setting

    tuned = Setting.of(TUNED)
    quarter = [lever("tuned", 2.0), lever(OUTER, 1.99), lever(SCHEDULE, 1.90)]
    full = [{**lever("tuned", 1.50), "fraction": 1.0}, {**lever(OUTER, 1.40), "fraction": 1.0}]
    assert lever_ratios(quarter + full, tuned) == pytest.approx({OUTER: 1.40 / 1.50, SCHEDULE: 0.95})
    assert chosen_levers(quarter + full, tuned) == (OUTER,)  # 6.7% at the full budget beats 5% at a quarter
    assert chosen_levers(quarter + [{**lever(OUTER, 1.40), "fraction": 1.0}], tuned) == (SCHEDULE,)  # no tuned there


def test_lockstep_diloco_of_one_learner_at_outer_lr_1_is_that_learner_trained_alone_by_any_merge_delay_or_fragments():
    """The lockstep reference against the in-process trainer, computed apart: one
    learner averaged with itself every H steps (outer lr 1, no momentum) is the learner
    alone, up to the rounding of Theta - (Theta - theta); two learners are not."""
    from bench.quality import base_recipe
    from bench.quality_runs import InProcess, Lockstep, train_in_process, train_lockstep

    recipe = base_recipe(quick=True)
    tokens = 24 * 8 * 64  # 24 steps of 8 sequences of 64 bytes
    alone = train_in_process(recipe, InProcess(6e-3, 8, tokens))
    one = train_lockstep(recipe, Lockstep(1, 6e-3, 8, 5, 1.0, 0.0, tokens))
    assert [at for at, _ in one["evaluations"]] == [at for at, _ in alone["evaluations"]]
    merged = [index for index in range(24) if (index + 1) % 5 == 0 or index == 23]  # between merges: the last one's
    assert [one["evaluations"][i][1] for i in merged] == pytest.approx(
        [alone["evaluations"][i][1] for i in merged], abs=1e-4
    )
    assert one["evaluations"][0][1] == one["evaluations"][3][1] != alone["evaluations"][0][1]  # the initial model
    one_rda = train_lockstep(recipe, Lockstep(1, 6e-3, 8, 5, 1.0, 0.0, tokens, merge="rda"))
    assert [one_rda["evaluations"][i][1] for i in merged] == pytest.approx(  # the RDA of one is itself
        [alone["evaluations"][i][1] for i in merged], abs=1e-4
    )
    two = train_lockstep(recipe, Lockstep(2, 6e-3, 8, 5, 1.0, 0.0, 2 * tokens))
    assert two["tokens"] == 2 * tokens and two["evaluations"][-1][0] == 2 * tokens
    assert two["evaluations"][-1][1] != pytest.approx(alone["evaluations"][-1][1], abs=1e-4)
    two_rda = train_lockstep(recipe, Lockstep(2, 6e-3, 8, 5, 1.0, 0.0, 2 * tokens, merge="rda"))
    assert two_rda["evaluations"][-1][1] != pytest.approx(two["evaluations"][-1][1], abs=1e-4)
    # a delayed install keeps what was trained since the send: one learner is still itself
    late = train_lockstep(recipe, Lockstep(1, 6e-3, 8, 6, 1.0, 0.0, tokens, fragments=2, delay_steps=2))
    assert late["evaluations"][-1][1] == pytest.approx(alone["evaluations"][-1][1], abs=1e-4)
    two_late = train_lockstep(recipe, Lockstep(2, 6e-3, 8, 5, 1.0, 0.0, 2 * tokens, delay_steps=2))
    assert two_late["evaluations"][-1][1] != pytest.approx(two["evaluations"][-1][1], abs=1e-4)


def test_the_lockstep_through_the_products_codecs_is_the_lockstep_in_fp32_and_not_in_int4_nor_on_dealt_text():
    """The product's quantization on the lockstep's way (learner sends, the regions'
    aggregates, the exact update, each with its error feedback): with fp32 codecs it is
    the plain lockstep's arithmetic up to float rounding; with the default int4 and int8
    it is not."""
    from bench.quality import base_recipe
    from bench.quality_runs import Lockstep, LockstepCodecs, train_lockstep
    from diloco_cli.config.recipe import Recipe

    recipe = base_recipe(quick=True)
    fp32 = {"learner_codec": {"codec": "fp32"}, "update_codec": {"codec": "fp32"}}
    exact = Recipe.model_validate({**recipe.model_dump(), "sync": {**recipe.sync.model_dump(), **fp32}})
    run = Lockstep(3, 6e-3, 8, 6, 0.7, 0.5, 3 * 24 * 8 * 64, merge="rda", fragments=2, delay_steps=2)
    plain = train_lockstep(exact, run)
    through = train_lockstep(exact, replace(run, codecs=True))
    assert [loss for _, loss in through["evaluations"]] == pytest.approx(
        [loss for _, loss in plain["evaluations"]], abs=1e-4
    )
    quantized = train_lockstep(recipe, replace(run, codecs=True))
    assert quantized["evaluations"][-1][1] != pytest.approx(plain["evaluations"][-1][1], abs=1e-4)
    dealt = train_lockstep(exact, replace(run, dealt=True))  # each learner on its own share of the text
    assert dealt["evaluations"][-1][1] != pytest.approx(plain["evaluations"][-1][1], abs=1e-4)
    codecs = LockstepCodecs(recipe, 3)
    assert [list(region) for region in codecs.regions] == [[0, 1], [2]]  # as bench._common.local_regions splits 3


def test_every_lever_and_yardstick_can_be_named_on_the_command_line():
    """``--levers`` and ``--adopt`` split their names on semicolons: no name may hold one."""
    from bench.quality_levers import DATA_PARALLEL_LEVERS, LEVERS, LOCKSTEPS, REPEATS, adopted

    yardsticks = [*LOCKSTEPS, *DATA_PARALLEL_LEVERS, *REPEATS]
    for name in [*LEVERS, *yardsticks]:
        assert adopted(name, *yardsticks) == (name,)


def test_a_data_parallel_yardstick_trains_data_parallel_at_its_changed_rate_read_against_its_own_row(tmp_path):
    """The other side of a lever tuned at a fraction of the budget: data-parallel run at
    half its learning rate, compared with the data-parallel row (not DiLoCo's tuned run)."""
    from bench.quality import Quality, data_parallel_loss, default_setting, diloco_recipe, parse_args, run_levers
    from bench.quality_runs import InProcess, train_in_process

    sitting = Quality(parse_args(["--quick", "--levers", "data-parallel at half its learning rate"]), tmp_path)
    setting = default_setting(sitting.base)
    row = sitting.run_row(DATA_PARALLEL, 0, setting)
    sync = {"row": sitting.rows.sync, "seed": 0, "setting": asdict(setting), "loss_1.0": 9.0, "seconds": 1.0}
    levers: list[dict] = []
    run_levers(sitting, setting, levers, [row, sync | {"evaluations": [[1, 9.0]]}], save=lambda setting: None)
    (lever,) = [lever for lever in levers if lever["lever"] != "tuned"]
    assert lever["changes"] == {"dp_learning_rate": setting.dp_learning_rate / 2}
    recipe = diloco_recipe(sitting.base, setting, 0, sitting.budget, sitting.rows.learners)
    half = train_in_process(recipe, InProcess(setting.dp_learning_rate / 2, setting.dp_batch, sitting.budget))
    assert lever["loss"] == pytest.approx(half["evaluations"][-1][1], rel=1e-6)
    assert lever["loss"] != pytest.approx(row["loss_1.0"], rel=1e-4)
    assert lever["vs_data_parallel"] == pytest.approx(lever["loss"] / row["loss_1.0"] - 1)
    assert "vs_tuned" not in lever  # DiLoCo's tuned run is not its yardstick
    assert data_parallel_loss([row], replace(setting, dp_batch=2 * setting.dp_batch), 1.0) is None
