"""A bounded cache of chunks read ahead on background threads.

The reader of a token range says which chunks it wants next, in order (the ones the
current batch needs, then the ones after); the cache starts reading the missing ones on
its threads while the caller trains on what it has, and keeps the chunks read before
while there is room (so a range that fits is read once, not once an epoch), dropping
the least recently wanted first.  A chunk being read counts as held, and a dropped read
still in flight is waited for before another starts, so at most ``capacity`` chunks
exist at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np


class ChunkCache:
    """At most ``capacity`` chunks, read by ``read(index)`` on ``threads`` threads."""

    def __init__(self, read: Callable[[int], np.ndarray], capacity: int, threads: int) -> None:
        self.capacity = capacity
        self._read = read
        self._held: dict[int, Future[np.ndarray]] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="diloco-data")

    def hold(self, wanted: Sequence[int]) -> None:
        """Hold the first ``capacity`` chunks of ``wanted``: start reading the missing
        ones (and again any whose read failed) in the order given, making room by
        dropping the chunks wanted longest ago."""
        keep = list(dict.fromkeys(wanted))[: self.capacity]
        for index in keep:
            future = self._held.pop(index, None)
            if future is None or (future.done() and future.exception() is not None):
                self._make_room(set(keep))
                future = self._pool.submit(self._read, index)
            self._held[index] = future  # the most recently wanted last

    def _make_room(self, keep: set[int]) -> None:
        while len(self._held) >= self.capacity:
            self._drop(next(index for index in self._held if index not in keep))

    def get(self, index: int) -> np.ndarray:
        """Chunk ``index``, which must be held, once read (raising what its read raised)."""
        return self._held[index].result()

    def _drop(self, index: int) -> None:
        future = self._held.pop(index)
        if not future.cancel():
            wait([future])  # its memory is freed before another read may start

    def close(self) -> None:
        """Stop reading and let go of every chunk."""
        for future in self._held.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self._held.clear()
