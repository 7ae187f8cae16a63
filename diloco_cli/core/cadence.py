"""Periodic duties of a loop that turns on an injected clock: the syncer's and the
reducers' heartbeat reads, status writes and sweeps."""

from __future__ import annotations


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
