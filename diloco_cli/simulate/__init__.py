"""Goodput under failures: an event-driven simulation of a training cluster.

N chips in slices; every chip is interrupted now and then (a Poisson process), which
takes its slice out for a repair.  Three ways to train on such a cluster are simulated
side by side: plain data-parallel (any failure stops everything; restart from the last
checkpoint), elastic data-parallel (pause, shrink, run on what is left, pause to grow
back) and Decoupled DiLoCo with M learners (a failure stops one learner; the others keep
training).  ``docs/goodput.md`` explains the model and its calibration.

Pure: numbers in, numbers out.  No torch, no storage, no terminal.
"""

from diloco_cli.simulate.constants import GoodputConstants, parse_chip_count
from diloco_cli.simulate.grid import GoodputGrid, simulate_grid

__all__ = ["GoodputConstants", "GoodputGrid", "parse_chip_count", "simulate_grid"]
