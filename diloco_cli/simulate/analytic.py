"""Closed forms beside the simulation: the checkpoint interval it uses and the goodput
it should reproduce where the answer is known exactly.

Failures are a Poisson process of rate ``rate`` per second.  A job that saves its work
every ``interval`` seconds of training at a cost of ``save`` seconds, and restarts in
``restart`` seconds after a failure (failures during a restart are taken by it: the job
is down already), completes one save segment of ``s = interval + save`` seconds in
expected wall time

    E[T] = (exp(rate * s) - 1) * (1 / rate + restart)

A renewal argument: an attempt at a segment succeeds with probability exp(-rate s); the
exp(rate s) - 1 failed attempts expected before it each run 1/rate - s / (exp(rate s) - 1)
on average and then restart.  (With restarts that start over when hit, Daly's 2006 model,
"A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS
22(3), eq. 13, the factor is exp(rate restart) / rate instead: it compounds as failures
come faster.)  The goodput is ``interval / E[T]``.
"""

from __future__ import annotations

import math


def daly_interval(save_seconds: float, mean_time_between_failures: float) -> float:
    """Daly's optimum training time between checkpoints (2006, eq. 37): for a checkpoint
    cost delta below twice the MTBF M, ``sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 +
    (delta / 2M) / 9) - delta``; else M.  Young's ``sqrt(2 delta M)`` is its first term."""
    if math.isinf(mean_time_between_failures):
        return math.inf
    if save_seconds >= 2 * mean_time_between_failures:
        return mean_time_between_failures
    ratio = save_seconds / (2 * mean_time_between_failures)
    return (
        math.sqrt(2 * save_seconds * mean_time_between_failures) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_seconds
    )


def restart_goodput(rate: float, interval: float, save: float, restart: float) -> float:
    """Expected share of wall time a restarting job spends on work it keeps (its own
    chips only): ``interval / E[T]`` above.  With no failures, ``interval / (interval +
    save)``; with no saves (infinite interval) and failures, zero."""
    if rate == 0:
        return 1.0 if math.isinf(interval) else interval / (interval + save)
    if math.isinf(interval):
        return 0.0
    return rate * interval / ((1.0 + rate * restart) * math.expm1(rate * (interval + save)))


def elastic_uptime(change_rate: float, pause: float) -> float:
    """Share of wall time an elastic job trains when membership changes arrive as a Poisson
    process of rate ``change_rate`` (failures and repairs) while it trains, each starting
    a pause of ``pause`` seconds that also takes the changes arriving during it: it
    trains ``1 / change_rate`` on average, then pauses ``pause``, so the uptime is
    ``1 / (1 + change_rate * pause)``."""
    return 1.0 / (1.0 + change_rate * pause)
