"""Synchronous data-parallel training's ring all-reduce: what each worker sends per step,
how many of the ring's hops cross between regions, and how long one all-reduce takes.

Pure formulas over numbers, the reference every plan and report compares Decoupled
DiLoCo with (docs/bandwidth.md); apart from :mod:`diloco_cli.bandwidth.model` so that a
report of a run's traffic (``diloco status`` prints its one line) does not load the
DiLoCo traffic model's shapes.
"""

from __future__ import annotations

from collections.abc import Iterable


def data_parallel_bytes_per_step(parameters: float, workers: int, bytes_per_value: float = 2) -> float:
    """What each worker sends, and receives, per step in a ring all-reduce::

        2 (W - 1) / W x bytes_per_value x parameters

    (a reduce-scatter then an all-gather, each W-1 steps of 1/W of the gradient).  The
    reference every report compares Decoupled DiLoCo's traffic with."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    return 2 * (workers - 1) / workers * bytes_per_value * parameters


def ring_region_crossings(learners_per_region: Iterable[int]) -> int:
    """How many hops of a ring all-reduce cross from one region to another: a ring that
    visits the regions in turn (as a placement by region gives) crosses once into each of
    the R regions that hold workers, and not at all when they are all in one region.  Each
    crossing carries one worker's :func:`data_parallel_bytes_per_step` each step, so the
    bytes between regions per step are ``crossings x bytes_per_step``."""
    regions = sum(1 for learners in learners_per_region if learners > 0)
    return regions if regions > 1 else 0


def hierarchical_wan_bytes_per_step(parameters: float, regions: int, bytes_per_value: float = 2) -> float:
    """What a hierarchical (region-aware) all-reduce sends between regions per step: each
    region reduces inside, one leader per region joins a ring all-reduce of the R leaders,
    and each leader broadcasts inside its region.  Only the leaders' ring crosses, each of
    its R hops carrying :func:`data_parallel_bytes_per_step` of R workers::

        R x 2 (R - 1) / R x bytes_per_value x parameters

    The strongest synchronous baseline on a WAN (a flat ring sends 2 (M-1)/M per crossing)."""
    if regions <= 1:
        return 0.0
    return regions * data_parallel_bytes_per_step(parameters, regions, bytes_per_value)


def ring_allreduce_seconds(
    bytes_per_step: float, workers: int, rate_bytes_per_second: float, latency_seconds: float
) -> float:
    """One ring all-reduce: ``bytes_per_step / rate + 2 (W - 1) x latency`` (every one of
    the 2(W-1) steps waits for its neighbour's chunk)."""
    if workers <= 1:
        return 0.0
    return bytes_per_step / rate_bytes_per_second + 2 * (workers - 1) * latency_seconds
