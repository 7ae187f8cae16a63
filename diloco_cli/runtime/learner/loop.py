"""The built-in learner: the training loop that ``diloco up`` runs in each learner process.

Started by a launcher (``diloco _learner``), possibly under ``torchrun``.  The loop reads
top to bottom like nanoGPT's: take the step's batch, one AdamW step (with gradient
accumulation, autocast, DDP or FSDP as the recipe says), then hand over to
:class:`~diloco_cli.runtime.learner.sync.LearnerSync`, which sends, installs, heartbeats
and checkpoints.  Exit codes: 0 finished, 143 stopped by a signal, 75 finished but could
not deliver its last payloads (the supervisor restarts it and it sends them again from
its final checkpoint), anything else a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from diloco_cli.codec import RunSecret
from diloco_cli.core.types import LearnerId
from diloco_cli.data.learner import LearnerData, open_learner_data
from diloco_cli.runtime.distributed import build_model, choose_device, join_process_group, leave_process_group
from diloco_cli.runtime.learner.context import TrainedModel
from diloco_cli.runtime.learner.sync import EXIT_FINISHED, EXIT_STOPPED, EXIT_UNDELIVERED, LearnerSync
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.store.run_spec import RunSpec
from diloco_cli.training.inner import InnerSchedule, inner_step, make_inner_optimizer, resolve_loss

__all__ = ["EXIT_FINISHED", "EXIT_STOPPED", "EXIT_UNDELIVERED", "Learner"]

log = logging.getLogger("diloco.learner")


class Learner:
    """One learner process (one rank of it under torchrun) running the built-in loop."""

    def __init__(
        self, spec: RunSpec, learner: LearnerId, secret: RunSecret, manifest: ManifestWatch | None = None
    ) -> None:
        self.spec = spec
        self.manifest = manifest
        self.recipe = spec.recipe
        self.me = spec.learner(learner)
        self.secret = secret
        self.stop_signalled = False

    def _request_stop(self, signum: int, _frame: object) -> None:
        log.info("signal %d: finishing the step, checkpointing where it stands, then stopping", signum)
        self.stop_signalled = True
        sync = getattr(self, "sync", None)  # not built yet while the learner sets up
        if sync is not None:
            sync.request_stop()

    def setup(self) -> None:
        training = self.recipe.training
        self.device = choose_device(training.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.group = join_process_group(self.device)
        if training.threads_per_learner:
            torch.set_num_threads(training.threads_per_learner)
        torch.manual_seed(training.seed)
        self.model, self.trained_model = build_model(
            self.recipe.model.build, self.device, self.group, training.parallelism, training.compile
        )
        self.optimizer = make_inner_optimizer(self.model, training.learning_rate, training.weight_decay, training.betas)
        self.schedule = InnerSchedule(
            training.learning_rate, training.warmup_steps, training.inner_steps, training.final_learning_rate_fraction
        )
        self.loss_fn = resolve_loss(training.loss)
        if training.batch_size % self.group.world_size:
            raise ValueError(
                f"training.batch_size {training.batch_size} must divide among {self.group.world_size} processes"
            )
        self.rank_batch = training.batch_size // self.group.world_size
        self.data_partition = self.spec.data_partition(self.me.id)
        self.data: LearnerData = open_learner_data(
            self.spec, self.me, self.group.rank, self.group.world_size, self.data_partition
        )
        self.tokens_per_step = training.batch_size * self.recipe.data.sequence_length
        trained = TrainedModel(self.model, self.optimizer, self.group, self.tokens_per_step, self.data)
        self.sync = LearnerSync(self.spec, self.me.id, self.secret, trained, self.manifest)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self.setup()
        if self.stop_signalled:  # a stop that came while it set up
            self.sync.request_stop()
        clean = False
        try:
            step = self._train()
            clean = True
            return step
        except BaseException:
            self.sync.failed()
            raise
        finally:
            self.data.close()
            leave_process_group(self.group, clean)

    def train_step(self) -> None:
        """One inner step on this step's batch, then the learner's sync duties."""
        training = self.recipe.training
        started = time.perf_counter()
        step = self.sync.step
        inputs, targets = self.data.batch(step, self.rank_batch)
        loss = inner_step(
            self.trained_model,
            self.optimizer,
            inputs.to(self.device),
            targets.to(self.device),
            self.schedule.learning_rate(step),
            training.gradient_clip,
            micro_batch_size=training.micro_batch_size,
            precision=training.precision,
            loss_fn=self.loss_fn,
        )
        speed = self.sync.spec.speed_of(self.me.id)  # the chaos plan followed: `diloco chaos` may change it
        if speed < 1.0:  # a slower chip, on purpose (--chaos slow-learner): its step takes 1/speed as long
            time.sleep((time.perf_counter() - started) * (1 / speed - 1))
        self.sync.after_step(loss, time.perf_counter() - started)

    def _train(self) -> int:
        self.sync.start()
        while self.sync.step < self.recipe.training.inner_steps and not self.sync.leaving:
            self._follow_data_partition()
            self.train_step()
        return self.sync.finish()

    def _follow_data_partition(self) -> None:
        """Train on the slice of the data the run assigns now (it changes when the run
        is scaled), from the position the step count gives."""
        partition = self.sync.data_partition
        if partition != self.data_partition:
            self.data.close()
            self.data = open_learner_data(self.spec, self.me, self.group.rank, self.group.world_size, partition)
            self.data.restore(None, self.sync.step)
            self.data_partition = partition
            self.sync.track_data(self.data)
