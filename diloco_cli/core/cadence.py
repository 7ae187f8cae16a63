"""Periodic duties of a loop that turns on an injected clock: the syncer's and the
reducers' heartbeat reads, status writes and sweeps, and when a run's end is near."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from diloco_cli.core.heartbeats import GONE_STATES


class Cadences:
    """When each named periodic task last ran; a task is due once ``every`` seconds have
    passed since (and counts as run from that moment).  Every task is due at first."""

    def __init__(self, *tasks: str) -> None:
        self._last = {task: float("-inf") for task in tasks}

    def due(self, task: str, now: float, every: float) -> bool:
        """Whether ``task`` is due at ``now``; if so, it counts as run at ``now``."""
        if now - self._last[task] < every:
            return False
        self._last[task] = now
        return True


END_READ_SECONDS = 5.0
"""How often the syncer and the reducers read heartbeats once a learner is due to finish."""


class Progress(Protocol):
    """What a learner's heartbeat says of its progress."""

    @property
    def state(self) -> Any: ...  # a state's ``value``, or the state's name itself

    step: int
    total_steps: int
    step_seconds: float | None
    time: float


def due_to_finish(reports: Iterable[Progress], now: float) -> bool:
    """Whether a learner that last reported going on should have trained its last step by
    ``now`` (wall clock): ``time + (total_steps - step) x step_seconds <= now``.  The run's
    end is near then, and its readers look at heartbeats every :data:`END_READ_SECONDS`
    instead of every heartbeat period (30 s in ``recipes/wan.yaml``): a run ends within
    seconds of its learners, not a few periods after them."""
    for report in reports:
        state = getattr(report.state, "value", report.state)
        if state not in GONE_STATES and report.step_seconds:
            if report.time + (report.total_steps - report.step) * report.step_seconds <= now:
                return True
    return False
