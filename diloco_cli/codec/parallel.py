"""Running the codec's kernels over fixed chunks of a tensor, on several threads.

A tensor is cut into chunks of about :data:`CHUNK_VALUES` values, whole quantization
blocks each, *whatever the number of threads*: each chunk is one kernel call (ctypes
and torch release the GIL while they compute), and what chunks return (the partial sums
of a norm) comes back in chunk order.  So a result never depends on how many threads
computed it: one thread and three add the same partial sums in the same order.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

CHUNK_VALUES = 1 << 18
"""Values per chunk (1 MiB of fp32): small enough that a thread's chunk of every operand
stays in its cache, large enough that a kernel call's overhead (a few microseconds) is
lost in its work."""

T = TypeVar("T")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def resolve_threads(setting: int) -> int:
    """``sync.merge_threads`` as a thread count: 0 means as many as the process's cores."""
    return setting if setting > 0 else available_cores()


VECTOR_VALUES = 64
"""Chunks start at multiples of this many values too, so that torch's vectorised loops
meet the same values in vector and in scalar code as on the whole tensor."""


def chunk_bounds(numel: int, block: int = 1) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of ``numel`` values; every start is a multiple
    of ``block`` (and so even, for int4's packed pairs, whose blocks are even) and of
    :data:`VECTOR_VALUES`."""
    unit = math.lcm(block, VECTOR_VALUES)
    step = max(1, CHUNK_VALUES // unit) * unit
    return [(start, min(step, numel - start)) for start in range(0, numel, step)]


class KernelPool:
    """Threads for chunked kernels, and one more for work that overlaps them (reading
    and verifying the next payload while this one is folded in).

    With one thread everything runs inline on the caller's thread, in order.  Not for
    concurrent use by several callers: a merge round owns it while it runs.
    """

    def __init__(self, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"a kernel pool needs at least one thread, got {threads}")
        self.threads = threads
        self._helpers = ThreadPoolExecutor(threads - 1, "diloco-kernel") if threads > 1 else None
        self._background = ThreadPoolExecutor(1, "diloco-prefetch") if threads > 1 else None

    def map_chunks(self, function: Callable[[int, int], T], numel: int, block: int = 1) -> list[T]:
        """``function(start, length)`` for every chunk of ``numel`` values, results in
        chunk order; the caller's thread works too."""
        bounds = chunk_bounds(numel, block)
        if self._helpers is None or len(bounds) < 2:
            return [function(start, length) for start, length in bounds]
        results: list[T | None] = [None] * len(bounds)
        claims = itertools.count()  # next() on a count is atomic under the GIL

        def work() -> None:
            for index in iter(lambda: next(claims), None):
                if index >= len(bounds):
                    return
                results[index] = function(*bounds[index])

        helpers = [self._helpers.submit(work) for _ in range(min(self.threads, len(bounds)) - 1)]
        try:
            work()
        finally:
            for helper in helpers:  # never leave a helper writing after an error returns
                helper.exception()
        for helper in helpers:
            helper.result()
        return results  # type: ignore[return-value]

    def background(self, function: Callable[[], T]) -> Future[T]:
        """Start ``function`` on the background thread (with one thread: run it now)."""
        if self._background is None:
            future: Future[T] = Future()
            try:
                future.set_result(function())
            except BaseException as error:  # handed to whoever asks the future
                future.set_exception(error)
            return future
        return self._background.submit(function)

    def close(self) -> None:
        for executor in (self._helpers, self._background):
            if executor is not None:
                executor.shutdown(wait=True)


@contextlib.contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """torch's own threads off while chunks run torch ops: an OpenMP team per op on each
    chunk oversubscribes the cores next to the pool's threads, and its threads spin at
    the op's barrier (measured on a 2-core machine under load: a chunked pass over 256
    MB took 9 s instead of 0.25 s).  A pool thread takes torch's setting at its first
    op, so pool threads that first run torch ops in here stay on one."""
    import torch

    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


SERIAL = KernelPool(1)
"""The pool of callers that did not ask for threads."""
