"""Anchored outer gradients from a window of recently published updates.

A learner that started from global version b sends ``delta_m = Theta^b - theta_m``.  The
syncer reconstructs ``theta_m = Theta^b - delta_m`` and merges the outer gradient
``Delta_m = Theta_now - theta_m = (Theta_now - Theta^b) + delta_m``, so a stale learner's
contribution includes the drift since its base (Decoupled DiLoCo, arXiv 2604.21428; the
same correction as asynchronous Local-SGD, arXiv 2401.09135).  ``Theta_now - Theta^b`` is
the sum of the updates published after b, of which the last W are kept per fragment; a
base older than that window cannot be anchored and the learner is told to resync.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from diloco_cli.core.types import Version

UpdateSource = Callable[[Mapping[str, torch.Tensor]], None]
"""Adds one published update of a fragment (decoded) into the tensors it is given, of
the fragment's names and shapes: ``source(drift)`` is ``drift[name] += U[name]``, each
tensor of U decoded onto the drift as :func:`~diloco_cli.codec.exact.apply_update` adds
it, so that no update-sized tensor is made."""


class BaseOutsideWindow(Exception):
    """A base version older than the window of kept updates (or newer than now)."""

    def __init__(self, base_version: Version, oldest_anchorable: Version, newest: Version) -> None:
        self.base_version = base_version
        self.oldest_anchorable = oldest_anchorable
        self.newest = newest
        super().__init__(
            f"base version {base_version} cannot be anchored: the window covers versions {oldest_anchorable}..{newest}"
        )


@dataclass(frozen=True)
class WindowEntry:
    version: Version
    add_to: UpdateSource


class UpdateWindow:
    """The last ``size`` published updates of one fragment, oldest first."""

    def __init__(self, size: int, oldest_anchorable: Version = Version(0)) -> None:
        if size < 1:
            raise ValueError(f"the update window must keep at least 1 update, got {size}")
        self.size = size
        self._entries: deque[WindowEntry] = deque()
        self._oldest_anchorable = oldest_anchorable
        self._newest = oldest_anchorable

    @property
    def oldest_anchorable(self) -> Version:
        """The oldest base version whose drift the window can still sum."""
        return self._oldest_anchorable

    @property
    def newest(self) -> Version:
        """The version of the last update recorded (the fragment's current version)."""
        return self._newest

    @property
    def versions(self) -> list[Version]:
        return [entry.version for entry in self._entries]

    def record(self, version: Version, add_to: UpdateSource) -> None:
        """Remember the update published as ``version``; the oldest drops out past W."""
        if version <= self._newest:
            raise ValueError(f"versions only grow: {version} after {self._newest}")
        self._entries.append(WindowEntry(version, add_to))
        self._newest = version
        while len(self._entries) > self.size:
            self._oldest_anchorable = self._entries.popleft().version

    def can_anchor(self, base_version: Version) -> bool:
        return self._oldest_anchorable <= base_version <= self._newest

    def check_anchorable(self, base_versions: Iterable[Version]) -> None:
        """Raise :class:`BaseOutsideWindow` for the first base this window cannot anchor."""
        for base in base_versions:
            if not self.can_anchor(base):
                raise BaseOutsideWindow(base, self._oldest_anchorable, self._newest)

    def drifts(
        self,
        base_versions: Iterable[Version],
        shapes: Mapping[str, tuple[int, ...]],
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> Iterator[tuple[Version, Mapping[str, torch.Tensor]]]:
        """Yield ``(b, Theta_now - Theta^b)`` for each distinct base, newest base first.

        The drift is built incrementally (each kept update is loaded at most once), and
        the same tensors are updated in place between yields: use them before the next
        one.  They are ``into`` (zeroed first) when given, so that a caller can reuse
        them from one round to the next, else new tensors.
        """
        bases = sorted(set(base_versions), reverse=True)
        self.check_anchorable(bases)
        if into is None:
            drift = {name: torch.zeros(shape) for name, shape in shapes.items()}
        else:
            drift = into
            for tensor in drift.values():
                tensor.zero_()
        pending = list(reversed(self._entries))
        for base in bases:
            while pending and pending[0].version > base:
                pending.pop(0).add_to(drift)
            yield base, drift


def anchored_outer_gradient(
    delta: Mapping[str, torch.Tensor], drift: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``Delta_m = (Theta_now - Theta^b) + delta_m`` for each tensor of a fragment."""
    return {name: drift[name] + tensor for name, tensor in delta.items()}
