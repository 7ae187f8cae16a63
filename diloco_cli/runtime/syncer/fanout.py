"""The syncer's calls to different regions, made at once.

Across a WAN every request costs a round trip, and each region has its own link: a
syncer that lists, reads and writes one region after the other leaves every link but
one idle, and at 40 ms one way its turn grows with the number of regions.  The syncer
hands each region's share of a turn (list and read new payloads, publish an update,
write its status) to one task per region and waits for all of them.  The tasks only
move bytes and return what they found; every decision and every tensor stays on the
syncer's own thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class FanOut:
    """A pool of threads, one per region, for storage calls only."""

    def __init__(self, width: int) -> None:
        self._pool = ThreadPoolExecutor(max(1, width), thread_name_prefix="region-io")

    def each(self, task: Callable[[Item], Result], items: Iterable[Item]) -> list[Result]:
        """``task(item)`` for every item at once; the results in the items' order.  A task
        that raises raises here (tasks catch what they expect and return it)."""
        return list(self._pool.map(task, items))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
