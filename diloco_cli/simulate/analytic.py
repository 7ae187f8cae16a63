"""Closed forms beside the simulation: the checkpoint interval it uses and the goodput
it should reproduce where the answer is known exactly.

Failures are a Poisson process of rate ``rate`` per second.  A job that saves its work
every ``interval`` seconds of training at a cost of ``save`` seconds, and restarts in
``restart`` seconds after a failure (a failure during a restart starts it over), completes
one save segment of ``interval + save`` seconds in expected wall time

    E[T] = exp(rate * restart) * (exp(rate * (interval + save)) - 1) / rate

(Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 22(3), 2006, eq. 13 without the downtime term), so its goodput is ``interval / E[T]``.
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
    return rate * interval * math.exp(-rate * restart) / math.expm1(rate * (interval + save))


def elastic_uptime(change_rate: float, pause: float) -> float:
    """Share of wall time an elastic job trains when membership changes arrive as a Poisson
    process of rate ``change_rate`` (failures and repairs) and each costs a pause of
    ``pause`` seconds, changes during a pause being taken by one more pause: a pause phase
    lasts ``pause * exp(change_rate * pause)`` on average, so the uptime is
    ``1 / (1 + change_rate * pause * exp(change_rate * pause))``."""
    load = change_rate * pause
    return 1.0 / (1.0 + load * math.exp(load))
