"""The quality benchmark's arithmetic on made-up curves: gaps to data-parallel's final
loss, the spread over seeds, tokens to reach a loss, the floor, and the targets' rule
(a gap within the seed-to-seed spread counts as met up to twice the spread)."""

import math

import pytest

from bench.quality import DATA_PARALLEL, EXTENDED, FLOOR, Rows, summarize, targets_of
from bench.quality_runs import loss_at, tokens_to_reach

NAMES = Rows(4, quick=False)


def row(label, seed, curve, **extra):
    tokens = curve[-1][0]
    losses = {f"loss_{f}": loss_at(curve, f * tokens) for f in (0.25, 0.5, 1.0)}
    return {"row": label, "seed": seed, "tokens": tokens, "seconds": 10.0, "evaluations": curve, **losses, **extra}


def test_tokens_to_reach_interpolates_between_the_evaluations_that_straddle_the_target():
    curve = [[100, 3.0], [200, 2.0], [300, 1.5]]
    assert tokens_to_reach(curve, 2.5) == pytest.approx(150)
    assert tokens_to_reach(curve, 3.0) == 100
    assert tokens_to_reach(curve, 1.4) is None
    assert loss_at(curve, 150) == 2.0  # the first evaluation at or past the tokens


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
    with pytest.raises(SystemExit, match="no row named 'DiLoCo M=3 K=M'.*floor: one learner alone"):
        quality_sitting(tmp_path, "DiLoCo M=3 K=M").plan([], {})
