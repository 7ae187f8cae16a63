"""What every simulated strategy shares: the cluster's failures and repairs, and the tally.

Each chip is interrupted at rate ``1 / MTBI``; an interruption takes the chip's slice out
for ``repair_seconds``.  The simulation draws candidate interruptions at the rate of the
whole cluster (every slice, ``slices * slice_chips / MTBI``) and lands each on a slice
chosen uniformly; one that lands on a slice already in repair is dropped.  That is exact
thinning: slices in service fail at their own rate, slices in repair not at all.  A repair
takes a fixed time, so slices come back in the order they failed: a FIFO queue of return
times instead of an event heap.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from diloco_cli.simulate.constants import GoodputConstants


@dataclass(frozen=True)
class Cluster:
    """The failure model of one simulated cluster."""

    slices: int
    slice_chips: int
    slice_failure_rate: float
    """Interruptions per second of one slice in service: ``slice_chips / MTBI``."""
    repair_seconds: float
    horizon_seconds: float

    @classmethod
    def of(cls, chips: int, constants: GoodputConstants) -> Cluster:
        return cls(
            slices=constants.slices(chips),
            slice_chips=constants.slice_chips,
            slice_failure_rate=constants.slice_chips / constants.mtbi_chip_seconds,
            repair_seconds=constants.repair_seconds,
            horizon_seconds=constants.horizon_seconds,
        )

    def next_candidate(self, now: float, rng: random.Random) -> float:
        """The time of the next candidate interruption after ``now`` (never, without failures)."""
        rate = self.slices * self.slice_failure_rate
        return now + rng.expovariate(rate) if rate > 0 else math.inf


@dataclass(frozen=True)
class Outcome:
    """What one replica of one strategy did over the horizon."""

    useful_slice_seconds: float
    """Slice-seconds of training that were kept: checkpointed, sent to a merge, or (for
    elastic data-parallel) simply done; the work in flight at the horizon counts."""
    up_seconds: float
    """Wall seconds during which some training ran (for DiLoCo: at least one learner)."""
    interruptions: int
    """Slices interrupted while in service."""
    cluster: Cluster

    @property
    def goodput(self) -> float:
        """Useful chip-time over the cluster's whole chip-time (spares included)."""
        return self.useful_slice_seconds / (self.cluster.slices * self.cluster.horizon_seconds)

    @property
    def uptime(self) -> float:
        return self.up_seconds / self.cluster.horizon_seconds
