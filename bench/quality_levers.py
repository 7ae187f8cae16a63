"""The levers of ``bench.quality``: recipe changes tried on the tuned DiLoCo run, the
lockstep yardsticks beside them, and the rule that picks what the rows run."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, replace

from bench.quality_runs import loss_at
from bench.quality_tuning import Setting

LEVERS: dict[str, Callable[[Setting, int], dict]] = {
    "AdamW beta2 0.99": lambda setting, steps: {"training": {"betas": [0.9, 0.99]}},
    "warmup 5% of the steps": lambda setting, steps: {"training": {"warmup_steps": max(1, steps // 20)}},
    "outer lr 1.4 (the anchors' rises with M)": lambda setting, steps: {
        "setting": {"outer_learning_rate": 1.4 * setting.outer_learning_rate}
    },
    "outer momentum 0.6 at lr 0.4 (the same long-run step, tens of rounds in)": lambda setting, steps: {
        "setting": {"outer_learning_rate": 0.4 * setting.outer_learning_rate, "outer_momentum": 0.6}
    },
    "fp32 up and down (no quantization)": lambda setting, steps: {
        "sync": {"learner_codec": {"codec": "fp32"}, "update_codec": {"codec": "fp32"}}
    },
    "outer lr 0.8 (a step short of the average)": lambda setting, steps: {
        "setting": {"outer_learning_rate": 0.8 * setting.outer_learning_rate}
    },
    "outer momentum 0.8 at lr 0.2 (the same long-run step, longer memory)": lambda setting, steps: {
        "setting": {"outer_learning_rate": 0.2 * setting.outer_learning_rate, "outer_momentum": 0.8}
    },
    "merge by the plain mean (DiLoCo's) instead of RDA": lambda setting, steps: {"sync": {"merge": "mean"}},
    "inner lr halved (tuned at an eighth of the budget, 8x fewer rounds)": lambda setting, steps: {
        "setting": {"inner_learning_rate": setting.inner_learning_rate / 2}
    },
    "inner and data-parallel lr halved (both tuned at an eighth of the budget)": lambda setting, steps: {
        "setting": {
            "inner_learning_rate": setting.inner_learning_rate / 2,
            "dp_learning_rate": setting.dp_learning_rate / 2,
        }
    },
    "H doubled (half the rounds, each twice as long)": lambda setting, steps: {
        "setting": {"sync_interval": 2 * setting.sync_interval}
    },
    "batch per learner doubled (the anchors find DiLoCo's best batch larger)": lambda setting, steps: {
        "setting": {"batch_per_learner": 2 * setting.batch_per_learner}
    },
    "polls 5x as often (learners every 0.2 s, the syncer and reducers every 0.15 s)": lambda setting, steps: {
        "training": {"poll_seconds": 0.2},
        "sync": {"poll_seconds": 0.15},
    },
    "sends paced by merges (each learner sends H steps after installing the merge of its last send)": (
        lambda setting, steps: {"sync": {"pace": "merges"}}
    ),
    "H by each learner's speed (dynamic local updates: a slower learner sends as often as the fastest)": (
        lambda setting, steps: {"sync": {"dynamic_local_updates": True}}
    ),
    "H/4 then H/2 over the first tenth": lambda setting, steps: {
        "sync": {
            "sync_interval_schedule": [
                [max(1, steps // 20), max(1, setting.sync_interval // 4)],
                [max(2, steps // 10), max(1, setting.sync_interval // 2)],
            ]
        }
    },
}
"""``--levers``: what the anchors use beyond the tuned settings, each tried alone on the
tuned M=4 K=M run at a quarter of the budget, given the setting and the learners' inner
steps: recipe sections, and under ``setting`` the fields of :class:`Setting` it changes
(the outer learning rate there, so that the K < M rows scale it as they scale the tuned
one).  Those that beat the tuned run by more than ``LEVER_GAIN`` are tried together,
and the better of that and the best one alone is what the rows run."""
LOCKSTEP = "lockstep reference (one process: no delay, fp32, whole model, i.i.d. data)"
"""Not a lever but the yardstick of one (``bench.quality_runs.Lockstep``): the tuned
setting's mathematics without the system around it; run by naming it in ``--levers``."""
LOCKSTEP_RDA = "lockstep reference with the product's merge (RDA)"
LOCKSTEPS: dict[str, dict] = {
    LOCKSTEP: {"merge": "mean"},
    LOCKSTEP_RDA: {"merge": "rda"},
    "lockstep reference with RDA and installs 5 steps after the send": {"merge": "rda", "delay_steps": 5},
    "lockstep reference with RDA and 2 staggered fragments": {"merge": "rda", "fragments": 2},
    "lockstep reference with RDA, 2 fragments and installs 5 steps late": {
        "merge": "rda",
        "fragments": 2,
        "delay_steps": 5,
    },
    "lockstep reference with 2 fragments and installs 5 steps late": {"fragments": 2, "delay_steps": 5},
    "lockstep reference with RDA, 2 fragments and installs 10 steps late (the product's median delay)": {
        "merge": "rda",
        "fragments": 2,
        "delay_steps": 10,
    },
    "lockstep reference with RDA, 2 fragments, installs 5 steps late and the product's codecs": {
        "merge": "rda",
        "fragments": 2,
        "delay_steps": 5,
        "codecs": True,
    },
    "lockstep reference with RDA, 2 fragments, installs 5 steps late and the text dealt as the product deals it": {
        "merge": "rda",
        "fragments": 2,
        "delay_steps": 5,
        "dealt": True,
    },
}
"""The yardsticks by name: the product's parts put back one at a time (the delay: about
5 of a learner's steps here, a round trip of 1-2 s at 3-4.5 steps a second, was the first
guess; read from a run's logs, a learner installs a merge a median 8-11 of its steps
after its send at the default polls, docs/benchmarks.md)."""
REPEATS = ("tuned again (no change: the product's run-to-run spread)", "tuned a third time (no change)")
"""The tuned run again, unchanged: an asynchronous run is not deterministic even at one
seed (which learner's send lands first moves with the machine's load), so a product
lever's verdict is judged against how far two runs of the same setting differ."""
AGAIN = ", run "
"""A product lever's name followed by ``, run 2`` (3, ...) runs that lever again, as
``REPEATS`` runs the tuned setting again: one run of a lever is read against the
product's own run-to-run span, and a verdict inside it needs more runs a side."""


def lever_of(name: str) -> str:
    """The lever a run by this name runs (itself, or the lever it runs again)."""
    return name.split(AGAIN)[0]


DATA_PARALLEL_LEVERS: dict[str, Callable[[Setting], Setting]] = {
    "data-parallel at half its learning rate": lambda setting: replace(
        setting, dp_learning_rate=setting.dp_learning_rate / 2
    ),
}
"""The other side's yardsticks: data-parallel's own setting changed (its row at seed 0,
compared with that row at the same fraction of the budget), so that a lever DiLoCo wins
at the full budget because both sides were tuned at a fraction of it (the inner
learning rate) is tried on data-parallel too before anything is called a gain."""
LEVER_GAIN = 0.01
"""Set when two runs of one setting at a quarter of the budget differed by 0.8%; three
runs of the tuned setting at one seed later spanned 1.8% at a quarter and 2.6% at the
full budget (``REPEATS``), so a product lever's verdict from one run a side is read only
beyond about 3% (docs/benchmarks.md).  No lever cleared even 1%, so none was adopted."""
LEVER_FRACTION = 0.25


def merged(sections: dict, overrides: dict) -> dict:
    """Recipe sections with ``overrides``' keys replacing theirs, section by section."""
    return {name: sections.get(name, {}) | overrides.get(name, {}) for name in {**sections, **overrides}}


def lever_changes(names: tuple[str, ...], setting: Setting, steps: int) -> tuple[Setting, dict]:
    """``setting`` with the levers ``names`` applied together: the setting they make and
    the recipe sections they add."""
    changes: dict = {}
    sections: dict = {}
    for name in names:
        made = dict(LEVERS[name](setting, steps))
        changes |= made.pop("setting", {})
        sections = merged(sections, made)
    return replace(setting, **changes), sections


def adopted(names: str, *others: str) -> tuple[str, ...]:
    """Levers by name (``--adopt``'s, or ``--levers``' with ``others`` allowed too)."""
    chosen = tuple(sorted(name.strip() for name in names.split(";") if name.strip()))
    known = [*LEVERS, *others]
    unknown = [part for name in chosen for part in lever_of(name).split(" + ") if part not in known]
    if unknown:
        raise SystemExit(f"no lever named {', '.join(map(repr, unknown))}; the levers: {', '.join(known)}")
    return chosen


def yardstick(name: str, setting: Setting, steps: int) -> tuple[dict, Setting, dict] | None:
    """A lockstep yardstick by name, with levers after it (``LOCKSTEP + LEVER + ...``):
    its options for :class:`bench.quality_runs.Lockstep`, the setting the levers make
    (naming them) and the recipe sections they add (the lockstep follows the training
    section's; it merges by its own options, not the sync section); None for a lever
    of the product."""
    first, *levers = name.split(" + ")
    if first not in LOCKSTEPS:
        return None
    changed, sections = lever_changes(tuple(levers), setting, steps)
    return LOCKSTEPS[first], replace(changed, levers=tuple(levers)), sections


def chosen_levers(levers: list[dict], tuned: Setting) -> tuple[str, ...]:
    """What the rows run of the levers measured at ``tuned``: those that beat the tuned
    run by more than ``LEVER_GAIN`` (at the longest fraction of the budget each was
    measured), together if that was measured better than the best of them alone, else
    the best alone."""
    ratios = lever_ratios(levers, tuned)
    winners = sorted((name for name in LEVERS if ratios.get(name, 1.0) < 1 - LEVER_GAIN), key=ratios.__getitem__)
    together = " + ".join(sorted(winners))
    if len(winners) > 1 and ratios.get(together, math.inf) < ratios[winners[0]]:
        return tuple(sorted(winners))
    return tuple(winners[:1])


def levers_at(levers: list[dict], setting: Setting, fraction: float) -> list[dict]:
    """The lever runs measured at ``setting`` and ``fraction`` of the budget (those kept
    from before fractions were recorded ran at ``LEVER_FRACTION``)."""
    return [
        lever
        for lever in levers
        if Setting.of(lever["setting"]) == setting and lever.get("fraction", LEVER_FRACTION) == fraction
    ]


def lever_ratios(levers: list[dict], setting: Setting) -> dict[str, float]:
    """Each lever's loss over the tuned run's, at the largest fraction of the budget at
    which both were measured: a longer run's verdict replaces a shorter one's."""
    ratios: dict[str, float] = {}
    for fraction in sorted({lever.get("fraction", LEVER_FRACTION) for lever in levers}):
        group = {lever["lever"]: lever["loss"] for lever in levers_at(levers, setting, fraction)}
        if "tuned" in group:
            ratios |= {name: loss / group["tuned"] for name, loss in group.items() if name != "tuned"}
    return ratios


def lever_record(
    name: str, stop: float, setting: Setting, changed: Setting, sections: dict, result: dict, tokens: float
) -> dict:
    """What a lever's run measured: its loss at ``stop`` of the ``tokens`` its schedule
    spans, and what it changed of ``setting``."""
    return {
        "lever": name,
        "fraction": stop,
        "sections": sections,
        "changes": {key: value for key, value in asdict(changed).items() if getattr(setting, key) != value},
        "setting": asdict(setting),
        "loss": loss_at(result["evaluations"], stop * tokens),
        "seconds": result["seconds"],
        "evaluations": result["evaluations"],
        "install_lag_steps": result.get("install_lag_steps"),
    }
