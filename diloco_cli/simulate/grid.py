"""The goodput table: every strategy at every cluster size, a few seeded replicas each."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

from pydantic import BaseModel, ConfigDict

from diloco_cli.simulate.analytic import daly_interval, elastic_uptime, restart_goodput
from diloco_cli.simulate.cluster import Cluster, Outcome
from diloco_cli.simulate.constants import (
    CALIBRATION_CHIPS,
    DEFAULT_CHIPS,
    DEFAULT_LEARNERS,
    SOURCE_GOODPUT,
    GoodputConstants,
)
from diloco_cli.simulate.elastic import simulate_elastic
from diloco_cli.simulate.restarting import simulate_restarting, split_evenly


@dataclass(frozen=True)
class Strategy:
    """``plain``, ``elastic``, or ``diloco`` with ``learners`` learners."""

    kind: str
    learners: int | None = None

    @property
    def name(self) -> str:
        return f"diloco M={self.learners}" if self.kind == "diloco" else self.kind


def strategies_for(learners: Sequence[int]) -> list[Strategy]:
    return [Strategy("plain"), Strategy("elastic"), *(Strategy("diloco", count) for count in learners)]


class Cell(BaseModel):
    """One strategy on one cluster size."""

    model_config = ConfigDict(frozen=True)

    chips: int
    strategy: str
    learners: int | None
    goodput: float
    """Mean over the replicas: useful chip-time over total chip-time."""
    uptime: float
    """Mean over the replicas: share of wall time some training ran."""
    goodput_replicas: list[float]
    interruptions_per_day: float
    save_interval_seconds: float | None
    """Training seconds between checkpoints (plain) or sends (DiLoCo)."""
    closed_form_goodput: float
    """The closed form for the same cell (analytic.py): exact in expectation for plain and
    DiLoCo while spares last; for elastic an approximation (repairs taken as independent
    of pauses)."""


class CalibrationPoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    strategy: str
    source: float
    simulated: float


class GoodputGrid(BaseModel):
    """The whole simulation: its constants, its seed and every cell."""

    model_config = ConfigDict(frozen=True)

    constants: GoodputConstants
    seed: int
    chips: list[int]
    strategies: list[str]
    cells: list[Cell]
    calibration: list[CalibrationPoint]
    """The source's figures at 1.2M chips beside the simulation (when 1.2M is in the grid)."""

    def cell(self, chips: int, strategy: str) -> Cell:
        return next(cell for cell in self.cells if cell.chips == chips and cell.strategy == strategy)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def simulate_once(chips: int, strategy: Strategy, constants: GoodputConstants, rng: random.Random) -> Outcome:
    """One replica of one strategy on a cluster of ``chips`` chips."""
    cluster = Cluster.of(chips, constants)
    if strategy.kind == "elastic":
        return simulate_elastic(cluster, constants.reconfigure_seconds, rng)
    groups = _groups(cluster, strategy, constants, chips)
    if strategy.kind == "plain":
        interval = _checkpoint_interval(cluster, groups[0], constants)
        return simulate_restarting(
            cluster, groups, interval, constants.checkpoint_seconds, constants.restart_seconds, rng
        )
    return simulate_restarting(
        cluster, groups, constants.send_interval_seconds, 0.0, constants.learner_restart_seconds, rng
    )


def simulate_cell(chips: int, strategy: Strategy, constants: GoodputConstants, seed: int) -> Cell:
    """``constants.replicas`` replicas, each with its own stream seeded from ``seed``, the
    cluster size and the strategy (so one cell never depends on which others ran)."""
    outcomes = [
        simulate_once(chips, strategy, constants, random.Random(f"{seed}/{chips}/{strategy.name}/{replica}"))
        for replica in range(constants.replicas)
    ]
    cluster = outcomes[0].cluster
    return Cell(
        chips=chips,
        strategy=strategy.name,
        learners=strategy.learners,
        goodput=fmean(outcome.goodput for outcome in outcomes),
        uptime=fmean(outcome.uptime for outcome in outcomes),
        goodput_replicas=[outcome.goodput for outcome in outcomes],
        interruptions_per_day=fmean(outcome.interruptions for outcome in outcomes) / constants.horizon_days,
        save_interval_seconds=_save_interval(cluster, strategy, constants, chips),
        closed_form_goodput=closed_form_goodput(chips, strategy, constants),
    )


def simulate_grid(
    constants: GoodputConstants,
    seed: int = 0,
    chips: Sequence[int] = DEFAULT_CHIPS,
    learners: Sequence[int] = DEFAULT_LEARNERS,
) -> GoodputGrid:
    """Every strategy (plain, elastic, DiLoCo with each M in ``learners``) at every size."""
    check_grid(constants, chips, learners)
    strategies = strategies_for(learners)
    cells = [simulate_cell(count, strategy, constants, seed) for count in chips for strategy in strategies]
    calibration = [
        CalibrationPoint(strategy=name, source=source, simulated=cell.goodput)
        for name, source in SOURCE_GOODPUT.items()
        for cell in cells
        if cell.chips == CALIBRATION_CHIPS and cell.strategy == name
    ]
    return GoodputGrid(
        constants=constants,
        seed=seed,
        chips=list(chips),
        strategies=[s.name for s in strategies],
        cells=cells,
        calibration=calibration,
    )


def check_grid(constants: GoodputConstants, chips: Sequence[int], learners: Sequence[int]) -> None:
    """Refuse a grid the cluster cannot hold: a learner needs at least one working slice."""
    for count in learners:
        if count < 1:
            raise ValueError(f"a DiLoCo run needs at least one learner, not {count}")
    for size in chips:
        working = constants.slices(size) - constants.spare_slices(size)
        if working < max(learners, default=1):
            raise ValueError(
                f"{size} chips make {working} working slices of {constants.slice_chips} chips (after spares): "
                f"too few for {max(learners)} learners; use more chips or a smaller slice_chips"
            )


def closed_form_goodput(chips: int, strategy: Strategy, constants: GoodputConstants) -> float:
    """The expected goodput of a cell from analytic.py (see ``Cell.closed_form_goodput``)."""
    cluster = Cluster.of(chips, constants)
    rate = cluster.slice_failure_rate
    if strategy.kind == "elastic":
        in_repair = (
            rate * cluster.repair_seconds / (1 + rate * cluster.repair_seconds)
        )  # each slice: up ~Exp, then a repair
        changes = 2 * cluster.slices * (1 - in_repair) * rate  # a failure and, later, its repair
        return (1 - in_repair) * elastic_uptime(changes, constants.reconfigure_seconds)
    groups = _groups(cluster, strategy, constants, chips)
    interval = _save_interval(cluster, strategy, constants, chips)
    save, restart = (
        (constants.checkpoint_seconds, constants.restart_seconds)
        if strategy.kind == "plain"
        else (0.0, constants.learner_restart_seconds)
    )
    return sum(size / cluster.slices * restart_goodput(size * rate, interval, save, restart) for size in groups)


def _groups(cluster: Cluster, strategy: Strategy, constants: GoodputConstants, chips: int) -> list[int]:
    working = cluster.slices - constants.spare_slices(chips)
    parts = 1 if strategy.kind == "plain" else strategy.learners
    assert working >= parts, "check_grid refuses a grid whose learners outnumber the working slices"
    return split_evenly(working, parts)


def _checkpoint_interval(cluster: Cluster, job_slices: int, constants: GoodputConstants) -> float:
    if constants.checkpoint_interval_seconds is not None:
        return constants.checkpoint_interval_seconds
    return daly_interval(
        constants.checkpoint_seconds,
        1 / (job_slices * cluster.slice_failure_rate) if cluster.slice_failure_rate else float("inf"),
    )


def _save_interval(cluster: Cluster, strategy: Strategy, constants: GoodputConstants, chips: int) -> float | None:
    if strategy.kind == "plain":
        return _checkpoint_interval(cluster, _groups(cluster, strategy, constants, chips)[0], constants)
    return constants.send_interval_seconds if strategy.kind == "diloco" else None
