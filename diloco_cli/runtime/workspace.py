"""What a process's merge rounds reuse from one round to the next: threads and buffers.

A round of a fragment needs fragment-sized running sums and a drift, and a decompressed
body for each payload being read.  Allocated afresh every round, each buffer costs the
kernel's page faults when first touched: measured here, as long as about seven copies of
it, more than the merge's own arithmetic.  A :class:`MergeWorkspace` keeps them: each role
has one flat buffer, grown to the largest fragment asked for, whose views it hands out
round after round.  It also owns the round's threads (``sync.merge_threads``).

The syncer keeps one for its rounds and each region's reducer one for its aggregates.
Between rounds it holds about three of the largest fragment (two sums and the drift)
plus two compressed-size bodies, which every round needed anyway.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from diloco_cli.codec import fold
from diloco_cli.codec.parallel import KernelPool

ALIGNMENT = 16
"""Views start at multiples of this many values (64 bytes, a cache line)."""


class MergeWorkspace:
    """Reusable buffers and a kernel pool for merge rounds, one round at a time: what it
    hands out for a role is valid until the next request for that role.  A
    :class:`~diloco_cli.core.merge.Workspace` for the merge's sums and norms."""

    def __init__(self, threads: int = 1) -> None:
        self.pool = KernelPool(threads)
        self._floats: dict[str, torch.Tensor] = {}
        self._bytes: dict[str, np.ndarray] = {}

    @property
    def threads(self) -> int:
        return self.pool.threads

    def tensors(self, role: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Uninitialised contiguous fp32 tensors of ``shapes``, views of ``role``'s buffer."""
        sizes = [-(-math.prod(shape) // ALIGNMENT) * ALIGNMENT for shape in shapes.values()]
        arena = self._floats.get(role)
        if arena is None or arena.numel() < sum(sizes):
            self._floats.pop(role, None)  # let the old one go first: one buffer per role at a time
            # numpy asks the kernel for huge pages, which fault in far faster than torch's
            arena = self._floats[role] = torch.from_numpy(np.empty(sum(sizes), np.float32))
        views, offset = {}, 0
        for (name, shape), size in zip(shapes.items(), sizes):
            views[name] = arena[offset : offset + math.prod(shape)].view(shape)
            offset += size
        return views

    def norm(self, tensor: torch.Tensor) -> float:
        """The L2 norm of a tensor, on the pool's threads (the same for any number)."""
        return fold.norm(tensor, self.pool)

    def buffer(self, role: str, nbytes: int) -> np.ndarray:
        """An uninitialised uint8 buffer of ``nbytes``, a view of ``role``'s buffer."""
        buffer = self._bytes.get(role)
        if buffer is None or buffer.nbytes < nbytes:
            self._bytes.pop(role, None)
            buffer = self._bytes[role] = np.empty(nbytes, np.uint8)
        return buffer[:nbytes]

    def close(self) -> None:
        """Stop the pool's threads and let the buffers go."""
        self.pool.close()
        self._floats.clear()
        self._bytes.clear()
