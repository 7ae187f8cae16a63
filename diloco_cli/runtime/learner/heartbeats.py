"""A learner's heartbeat: what it is doing, how far it is, what it refused, every few seconds.

The syncer reads heartbeats for liveness, step times (its grace window) and refused
objects to repair; ``diloco status`` shows them.  Only the newest matters, so one is in
flight at most and a newer one replaces one still waiting
(:class:`~diloco_cli.runtime.learner.outbox.LatestUpload`).  Storage counts and refusals
continue those of the learner's previous start.
"""

from __future__ import annotations

import os
import time

import numpy as np

from diloco_cli.runtime.learner.context import LearnerContext
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.runtime.learner.outbox import LatestUpload
from diloco_cli.runtime.learner.progress import Progress
from diloco_cli.runtime.learner.sends import Sends
from diloco_cli.store.documents import Heartbeat, LearnerState, Refusals
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.region import RegionBucket
from diloco_cli.store.run_spec import LearnerSpec


class Heartbeats:
    """The storage rank's heartbeats, every ``training.heartbeat_seconds``."""

    def __init__(
        self,
        context: LearnerContext,
        progress: Progress,
        sends: Sends,
        refusals: Refusals,
        storage_before: StorageCounters,
    ) -> None:
        training = context.recipe.training
        self.bucket: RegionBucket = context.bucket
        self.learner: LearnerSpec = context.me
        self.fragments: LearnerFragments = context.fragments
        self.processes, self.total_steps = context.group.world_size, training.inner_steps
        self.progress, self.sends, self.refusals = progress, sends, refusals
        self.storage_before = storage_before
        """What earlier starts of this learner moved (their last heartbeat said)."""
        self.every_seconds = training.heartbeat_seconds
        self._uploads = LatestUpload("heartbeat")
        self._last = float("-inf")

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every_seconds

    def beat(self, state: LearnerState | None = None, wait: float = 0.0) -> None:
        """Write a heartbeat, now in ``state`` if given; with ``wait``, for up to that many
        seconds until it is written (raises StorageError if it is not)."""
        self._last = time.monotonic()
        p = self.progress
        if state:
            p.state = state
        epoch = self.sends.epoch
        beat = Heartbeat(
            learner=self.learner.id,
            region=self.learner.region,
            host=self.learner.host,
            pid=os.getpid(),
            processes=self.processes,
            state=p.state,
            step=p.step,
            total_steps=self.total_steps,
            tokens=p.tokens,
            loss=p.loss if p.loss is not None and np.isfinite(p.loss) else None,
            step_seconds=p.step_seconds,
            compute_seconds=p.compute_seconds,
            base_versions=dict(self.fragments.base_version),
            sends=self.sends.made,
            delivered=self.sends.outbox.delivered,
            unsent=self.sends.outbox.waiting,
            installs=p.installs,
            install_lag_steps=p.install_lag_steps,
            tokens_overwritten=dict(self.fragments.tokens_overwritten),
            checkpoint_step=p.checkpoint_step,
            restarts=epoch - 1,
            epoch=epoch,
            storage=self.storage_before.plus(self.bucket.store.meter.snapshot()),
            refusals=self.refusals.model_copy(deep=True),
            started_at=p.started_at,
            training_since=p.training_since,
            time=time.time(),
        )
        self._uploads.submit(self.bucket.write_heartbeat, beat)
        if wait and not self._uploads.flush(wait):
            raise StorageError(f"the heartbeat of {self.learner.id} could not be written in {wait:.0f} s")

    def close(self) -> None:
        self._uploads.close()
