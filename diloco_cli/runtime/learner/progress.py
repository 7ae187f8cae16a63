"""How far a learner is: its step and tokens, loss, speed, and what it has done so far.

Kept by every process of the learner (the step drives every cadence), reported by the
storage rank in its heartbeats and log lines.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.store.documents import LearnerState

STEP_TIME_SMOOTHING = 0.2
"""Weight of the newest step in the moving average of step time that heartbeats report
(the syncer's grace window reads it)."""
LOG_EVERY_STEPS = 50
INSTALL_LAGS_KEPT = 25
"""The latest installs whose lag (steps from the send to the install) a heartbeat's
median reads."""


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_seconds: float | None = None
    """Moving average of an inner step's compute time."""
    compute_seconds: float = 0.0
    """Time spent in inner steps (forward, backward, optimizer) since this start."""
    sends: int = 0
    installs: int = 0
    checkpoint_step: int | None = None
    state: LearnerState = LearnerState.STARTING
    started_at: float = field(default_factory=time.time)
    training_since: float | None = None
    """When the loop's first step began (after setup and the first install)."""

    install_lags: deque[int] = field(default_factory=lambda: deque(maxlen=INSTALL_LAGS_KEPT))
    """Steps from a send to the install that followed it, latest installs."""

    def count_installs(self, lags: Iterable[int | None]) -> None:
        """One look's installs, with each fragment's lag (None: nothing sent since the last)."""
        self.installs += 1
        self.install_lags.extend(lag for lag in lags if lag is not None)

    @property
    def install_lag_steps(self) -> float | None:
        """The median of the latest installs' lags."""
        return statistics.median(self.install_lags) if self.install_lags else None

    def count_step(self, loss: float | None, compute_seconds: float | None, tokens: int) -> int:
        """One more inner step of ``tokens`` tokens; returns the new step count."""
        self.step += 1
        self.tokens += tokens
        self.loss = loss
        if compute_seconds is not None:
            self.compute_seconds += compute_seconds
            w = STEP_TIME_SMOOTHING
            previous = self.step_seconds
            self.step_seconds = compute_seconds if previous is None else (1 - w) * previous + w * compute_seconds
        return self.step

    def log_due(self) -> bool:
        return self.step % LOG_EVERY_STEPS == 0

    def line(self, total_steps: int, base_versions: Mapping[FragmentIndex, Version]) -> str:
        """The log line: step, loss, speed and the base version of every fragment."""
        versions = ", ".join(f"{p}:{v}" for p, v in sorted(base_versions.items()))
        speed = f"{1 / self.step_seconds:.2f} steps/s " if self.step_seconds else ""
        loss = f"loss {self.loss:.4f} " if self.loss is not None else ""
        return f"step {self.step}/{total_steps} {loss}{speed}base versions {versions}"
