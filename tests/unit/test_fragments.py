"""Splitting a model into fragments and the staggered send schedule."""

import random

import pytest
import torch

from diloco_cli.core.fragments import (
    FragmentError,
    fragments_due,
    fragments_of_model,
    scheduled_sync_interval,
    sends_per_learner,
    split_into_fragments,
)


class TiedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.wide = torch.nn.Linear(8, 64)
        self.head = torch.nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight


def test_embedding_and_tied_head_form_their_own_fragment():
    fragments = fragments_of_model(TiedModel(), 3)
    assert fragments[0].parameter_names == ("embed.weight",)
    assert fragments[0].mean_names == {"embed.weight"}
    names = [name for fragment in fragments for name in fragment.parameter_names]
    assert sorted(names) == sorted(name for name, _ in TiedModel().named_parameters())
    assert len(names) == len(set(names))


def test_greedy_packing_balances_bytes_deterministically():
    sizes = [("a", 100), ("b", 60), ("c", 50), ("d", 40), ("e", 10)]
    fragments = split_into_fragments(sizes, 2)
    # largest first into the lightest: a->0 (100), b->1 (60), c->1 (110), d->0 (140), e->1 (120)
    assert [f.parameter_names for f in fragments] == [("a", "d"), ("b", "c", "e")]
    assert [f.num_bytes for f in fragments] == [140, 120]
    assert split_into_fragments(sizes, 2) == fragments


def test_one_fragment_holds_everything_and_keeps_embedding_marks():
    (fragment,) = fragments_of_model(TiedModel(), 1)
    assert fragment.mean_names == {"embed.weight"}
    assert len(fragment.parameter_names) == len(list(TiedModel().parameters()))


def test_under_merge_mean_every_tensor_of_every_fragment_is_merged_by_the_mean():
    fragments = fragments_of_model(TiedModel(), 2, merge="mean")
    assert [f.mean_names for f in fragments] == [frozenset(f.parameter_names) for f in fragments]
    assert fragments_of_model(TiedModel(), 2)[1].mean_names == frozenset()  # rda: the embedding's alone


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(FragmentError, match="lower num_fragments"):
        split_into_fragments([("a", 1), ("b", 2)], 4)
    with pytest.raises(FragmentError, match="at least 1"):
        split_into_fragments([("a", 1)], 0)


def test_staggered_schedule_sends_each_fragment_every_h_steps():
    H, P = 10, 4
    sends = {p: [s for s in range(1, 61) if p in fragments_due(s, H, P)] for p in range(P)}
    assert sends[0] == [10, 20, 30, 40, 50, 60]
    assert sends[1] == [2, 12, 22, 32, 42, 52]
    assert sends[2] == [5, 15, 25, 35, 45, 55]
    assert sends[3] == [7, 17, 27, 37, 47, 57]
    assert fragments_due(0, H, P) == []
    assert fragments_due(50, 50, 1) == [0]


def test_dynamic_local_updates_scale_h_by_speed():
    from diloco_cli.core.fragments import dynamic_sync_intervals

    # speeds 1, 0.8, 0.6 (step times 1/speed): H_m = floor(25 * speed / 1)
    assert dynamic_sync_intervals(25, {"a": 0.1, "b": 0.125, "c": 0.1 / 0.6}) == {"a": 25, "b": 20, "c": 15}
    assert dynamic_sync_intervals(4, {"fast": 1.0, "crawling": 100.0}) == {"fast": 4, "crawling": 1}  # at least 1
    assert dynamic_sync_intervals(25, {"unknown": 0.0}) == {}


def test_a_schedule_gives_each_step_its_stage_h():
    schedule = ((100, 25), (200, 50))
    assert [scheduled_sync_interval(step, schedule, 100, 100) for step in (1, 99, 100, 199, 200, 5000)] == [
        25,
        25,
        50,
        50,
        100,
        100,
    ]
    # dynamic local updates: a learner told H_m = 50 of the recipe's 100 sends twice as often in every stage
    assert [scheduled_sync_interval(step, schedule, 50, 100) for step in (1, 150, 300)] == [12, 25, 50]
    assert scheduled_sync_interval(1, ((10, 1),), 30, 100) == 1  # never below 1


def test_schedule_sends_by_hand():
    """[[100, 25]] then H=100, two fragments, 300 steps: fragment 0 at 25, 50, 75 then
    100, 200, 300; fragment 1 at 12, 37, 62, 87 then 150, 250 and the end's flush: 14."""
    due = {p: [s for s in range(1, 301) if p in fragments_due(s, 25 if s < 100 else 100, 2)] for p in (0, 1)}
    assert due == {0: [25, 50, 75, 100, 200, 300], 1: [12, 37, 62, 87, 150, 250]}
    assert sends_per_learner(300, 100, 2, ((100, 25),)) == 6 + 6 + 1


@pytest.mark.parametrize("seed", range(40))
def test_the_closed_form_counts_the_sends_a_learner_makes(seed):
    """The plan's count equals stepping through a run with the learner's own rule."""
    rng = random.Random(seed)
    steps, interval, fragments = rng.randint(1, 400), rng.randint(1, 120), rng.randint(1, 4)
    untils = sorted(rng.sample(range(1, 500), rng.randint(0, 3)))
    schedule = tuple((until, rng.randint(1, 60)) for until in untils)
    last, sends = [0] * fragments, 0
    for step in range(1, steps + 1):
        for p in fragments_due(step, scheduled_sync_interval(step, schedule, interval, interval), fragments):
            sends, last[p] = sends + 1, step
    sends += sum(step < steps for step in last)  # the end's flush
    assert sends_per_learner(steps, interval, fragments, schedule) == sends
