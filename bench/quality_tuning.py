"""Tuning both sides the same way: one setting at a time, at a fraction of the budget.

Data-parallel's learning rate and global batch, and DiLoCo's inner learning rate, outer
learning rate with momentum, H and batch per learner (at the headline M, K=M), each
tried over a short grid with the others at their best so far, on the full run's
schedule stopped at ``--tuning-fraction`` of the budget.  Every trial is kept (its side's
whole setting and its loss), so a resumed run tries only what it has not tried.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

DATA_PARALLEL_SIDE = "data-parallel"
DILOCO_SIDE = "DiLoCo"


@dataclass(frozen=True)
class Setting:
    """What tuning chooses, for both sides."""

    dp_learning_rate: float
    dp_batch: int
    """Data-parallel's global batch, in sequences."""
    inner_learning_rate: float
    outer_learning_rate: float
    """At K = M; the K < M rows scale it as the recipe's ``auto`` does, by sqrt(K/M)."""
    outer_momentum: float
    sync_interval: int
    batch_per_learner: int
    install: str
    """``sync.install`` at K = M: ``overwrite`` loses what a learner trained on a fragment
    between its send and the new version's arrival; ``keep-unsent`` keeps it.  The K < M
    rows keep the recipe's ``auto`` (keep-unsent)."""
    levers: tuple[str, ...] = ()
    """Recipe changes chosen after tuning (``bench.quality.LEVERS``), applied to DiLoCo's
    runs: tuning never sets them, so its trials do not depend on them."""

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Setting:
        """A setting as a result file keeps it (JSON: lists for tuples, no levers before
        there were any)."""
        return cls(**{**fields, "levers": tuple(fields.get("levers", ()))})

    def of_side(self, side: str) -> dict[str, Any]:
        """The fields that decide a trial of ``side`` (a data-parallel trial does not
        depend on DiLoCo's settings, nor the reverse)."""
        fields = asdict(self)
        del fields["levers"]
        if side == DATA_PARALLEL_SIDE:
            return {key: value for key, value in fields.items() if key.startswith("dp_")}
        return {key: value for key, value in fields.items() if not key.startswith("dp_")}


@dataclass(frozen=True)
class Knob:
    side: str
    name: str
    """A field of :class:`Setting`, or ``outer`` (learning rate and momentum together:
    momentum multiplies the outer step's effective size by up to 1 / (1 - mu))."""
    values: tuple

    def apply(self, setting: Setting, value: Any) -> Setting:
        if self.name == "outer":
            learning_rate, momentum = value
            return replace(setting, outer_learning_rate=learning_rate, outer_momentum=momentum)
        return replace(setting, **{self.name: value})

    def value_of(self, setting: Setting) -> Any:
        if self.name == "outer":
            return (setting.outer_learning_rate, setting.outer_momentum)
        return getattr(setting, self.name)


def full_knobs() -> tuple[Knob, ...]:
    """The grids of the full run, in the order they are tuned: data-parallel's learning
    rate again after its batch (the best rate moves with the batch); DiLoCo's installs
    first (overwriting loses the steps between a send and its merge's arrival, a share
    that grows with the latency of a round), then its outer step, the setting measured
    most sensitive at small scale (at 2.5M tokens, momentum 0.9 at lr 0.7 lost to one
    learner alone and plain averaging was best)."""
    learning_rates = (3e-3, 6e-3, 1e-2)
    return (
        Knob(DATA_PARALLEL_SIDE, "dp_learning_rate", learning_rates),
        Knob(DATA_PARALLEL_SIDE, "dp_batch", (16, 32, 64, 128)),
        Knob(DATA_PARALLEL_SIDE, "dp_learning_rate", learning_rates),
        Knob(DILOCO_SIDE, "install", ("overwrite", "keep-unsent")),
        Knob(DILOCO_SIDE, "outer", ((1.0, 0.0), (1.0, 0.5), (0.7, 0.9), (0.3, 0.9))),
        Knob(DILOCO_SIDE, "sync_interval", (10, 25, 50)),
        Knob(DILOCO_SIDE, "inner_learning_rate", learning_rates),
        Knob(DILOCO_SIDE, "batch_per_learner", (4, 8, 16, 32)),
    )


def quick_knobs() -> tuple[Knob, ...]:
    """Two values for data-parallel (the choice), one for DiLoCo (its trial's path)."""
    return (
        Knob(DATA_PARALLEL_SIDE, "dp_learning_rate", (3e-3, 6e-3)),
        Knob(DILOCO_SIDE, "sync_interval", (10,)),
    )


Trial = Callable[[str, Setting], dict]
"""Runs one tuning trial of a side at a setting: ``{"loss": ..., "seconds": ...}``."""


def tune(
    start: Setting, knobs: tuple[Knob, ...], trials: list[dict], run: Trial, after: Callable[[], object] = lambda: None
) -> Setting:
    """Coordinate descent over ``knobs`` from ``start``: each knob's values tried with
    the rest at their best so far, the lowest loss kept.  ``trials`` holds what was
    tried before (kept, not rerun) and gains each new trial as it finishes (then
    ``after`` is called: the benchmark writes its result file)."""
    best = start
    for knob in knobs:
        losses = {}
        for value in knob.values:
            candidate = knob.apply(best, value)
            key = candidate.of_side(knob.side)
            earlier = next((t for t in trials if t["side"] == knob.side and t["setting"] == key), None)
            if earlier is None:
                earlier = {"side": knob.side, "knob": knob.name, "value": value, "setting": key}
                earlier |= run(knob.side, candidate)
                trials.append(earlier)
                after()
                print(f"  tuning {knob.side} {knob.name} {value}: {earlier['loss']:.4f}", flush=True)
            losses[value] = earlier["loss"]
        best = knob.apply(best, min(losses, key=losses.__getitem__))
    return best
