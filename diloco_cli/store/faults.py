"""Storage outages injected inside the store layer (chaos mode), for any backend.

A bucket built for a region under a chaos plan (:mod:`diloco_cli.config.chaos`) checks,
before every call, whether the region's storage is down now; if so the call fails with
a ``ConnectionError`` (or first hangs, as a black-holed link would), which the retry
policy treats like any transient failure of a real bucket.  So an injected outage takes
exactly the paths a real one does: retries, metering, the outbox, regions left behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from diloco_cli.config.chaos import ChaosPlan

LONGEST_HANG_SECONDS = 60.0
"""A hanging call fails after at most this long even if the outage lasts longer."""


@dataclass(frozen=True)
class OutageWindow:
    start: float
    """Epoch seconds."""
    end: float
    hang: bool


class StorageFaults:
    """The outage windows of one region's bucket, checked before every call."""

    def __init__(
        self,
        region: str,
        windows: tuple[OutageWindow, ...],
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.region, self.windows = region, windows
        self._clock, self._sleep = clock, sleep

    @classmethod
    def of(cls, plan: ChaosPlan | None, region: str, regions: list[str], started_at: float) -> StorageFaults | None:
        """The faults of ``region`` in a run created at ``started_at`` (None: none)."""
        if plan is None:
            return None
        origin = started_at + plan.begins_at_seconds
        windows = tuple(
            OutageWindow(
                origin + outage.start_seconds,
                origin + outage.start_seconds + outage.duration_seconds,
                outage.mode == "hang",
            )
            for outage in plan.outage_windows(regions)
            if outage.region == region
        )
        return cls(region, windows) if windows else None

    def current(self) -> OutageWindow | None:
        now = self._clock()
        return next((window for window in self.windows if window.start <= now < window.end), None)

    def check(self, what: str) -> None:
        """Raise (after hanging, for a hanging outage) when the storage is down now."""
        window = self.current()
        if window is None:
            return
        if window.hang:
            self._sleep(max(0.0, min(window.end - self._clock(), LONGEST_HANG_SECONDS)))
        raise ConnectionError(
            f"chaos: the storage of region {self.region} is down until "
            f"{time.strftime('%H:%M:%S', time.localtime(window.end))} ({what})"
        )
