"""Everything a learner does besides training, each duty at its cadence.

:class:`LearnerSync` wraps any training loop, the built-in one
(:mod:`diloco_cli.runtime.learner.loop`) or a user's own (:func:`diloco_cli.join`): the
loop calls :meth:`~LearnerSync.start` once, :meth:`~LearnerSync.after_step` after every
inner optimizer step, and :meth:`~LearnerSync.finish` at the end.  ``after_step`` reads
as the list of the learner's duties (docs/algorithm.md, "A learner"):

* send every fragment now due (:mod:`.sends`, delivered in order by :mod:`.outbox`);
* install newer global weights a finished look found (:mod:`.poller`), and follow the
  syncer's note (:mod:`.control`), both by :mod:`.installs`; then start the next look;
* heartbeat (:mod:`.heartbeats`) and take in a new chaos plan, every few seconds;
* checkpoint (:mod:`.checkpoints`) every ``training.checkpoint_every_steps``;
* a log line every few steps (:mod:`.progress`).

Under ``torchrun`` every process of the learner calls these at the same points: sends,
installs and checkpoints are collectives (the full values of sharded parameters are
gathered to rank 0 and installed values scattered back), and only rank 0, the storage
rank, touches storage.  Storage I/O runs on the collaborators' threads, but tensors the
model depends on (parameters, bases, residuals, counters) are read and written by the
training thread alone, here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from diloco_cli.codec import RunSecret
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.runtime.coordinator import EXIT_FINISHED, EXIT_STOPPED
from diloco_cli.runtime.distributed import (
    full_parameters,
    install_parameters,
    load_full_optimizer_state,
)
from diloco_cli.runtime.global_weights import GlobalReader
from diloco_cli.runtime.learner.checkpoints import Checkpoints, ResumePoint
from diloco_cli.runtime.learner.context import DataPosition, TrainedModel, learner_context
from diloco_cli.runtime.learner.control import FinalSends, Install, Instructions, StartPoint, share
from diloco_cli.runtime.learner.heartbeats import Heartbeats
from diloco_cli.runtime.learner.installs import Installs
from diloco_cli.runtime.learner.poller import GlobalPoller, Poll
from diloco_cli.runtime.learner.progress import Progress
from diloco_cli.runtime.learner.sends import Sends, resume_epoch
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.store.documents import LearnerState, Refusals
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.learner")

EXIT_UNDELIVERED = 75
DELIVERY_SECONDS_AT_FINISH = 600.0
"""How long a finished learner keeps trying to deliver its last payloads."""
DELIVERY_SECONDS_AT_STOP = 20.0


class LearnerSync:
    """A learner's membership in a run, around a model and its inner optimizer."""

    def __init__(
        self,
        spec: RunSpec,
        learner: LearnerId,
        secret: RunSecret,
        trained: TrainedModel,
        manifest: ManifestWatch | None = None,
    ) -> None:
        self.spec, self.recipe, self.secret = spec, spec.recipe, secret
        self.context = context = learner_context(spec, learner, secret, trained)
        self.me = context.me
        self.model, self.optimizer, self.group = trained.model, trained.optimizer, trained.group
        self.tokens_per_step = trained.tokens_per_step
        self.data_position = trained.data_position
        self.manifest = manifest
        """The run's manifest, followed for a new chaos plan (``diloco chaos``)."""
        self._stop_signalled = False
        self.start_step = 0
        """The step this start resumed at (a stop checkpoints only if it trained since)."""
        self.progress = Progress()
        self.fragment_list, self.parameter_names = context.fragment_list, context.parameter_names
        # On the storage rank only: the bookkeeping and the duties that touch storage.
        self.fragments, self.bucket = context.fragments, context.bucket
        self.checkpoints = Checkpoints(context, trained)
        if self.group.is_storage_rank:
            self.refusals = Refusals()
            epoch, previous = resume_epoch(self.bucket, self.me.id, self._refused)
            if previous is not None:
                self.refusals = previous.refusals.plus(self.refusals)
            self.sends = Sends(self.bucket, self.me.id, epoch, self.fragments, self.recipe.sync.learner_codec, secret)
            readers = [
                GlobalReader(self.bucket, secret, self.fragment_list, shard=spec.syncer_shard(shard.index))
                for shard in spec.syncer_shards
            ]
            training = self.recipe.training
            self.poller = GlobalPoller(readers, self.me.id, training.poll_seconds, training.awaiting_poll_seconds)
            storage_before = previous.storage if previous is not None else StorageCounters()
            self.heartbeats = Heartbeats(context, self.progress, self.sends, self.refusals, storage_before)
            self.installs = Installs(context, self.model, self.progress, self.poller, self._refused)
        else:
            self.installs = Installs(context, self.model, self.progress)

    # ------------------------------------------------------------- what a loop reads

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def total_steps(self) -> int:
        return self.recipe.training.inner_steps

    @property
    def instructions(self) -> Instructions:
        """What the run asks of this learner now (:class:`~.installs.Installs` follows it)."""
        return self.installs.instructions

    @property
    def stop_requested(self) -> bool:
        """Whether ``diloco down`` (a signal) asked this learner to stop (as every process
        of the learner has heard it, after the step that took it in)."""
        return self.instructions.stop

    def request_stop(self) -> None:
        """``diloco down`` (SIGTERM): stop at the next step boundary.  Safe in a signal
        handler: it only raises a flag, which the storage rank folds into the instructions
        every process receives after a step (or at the start), so all stop at one step."""
        self._stop_signalled = True

    @property
    def drain_requested(self) -> bool:
        """Whether the syncer told this learner to leave the run (``diloco scale``)."""
        return self.instructions.drain

    @property
    def leaving(self) -> bool:
        """Whether the loop should end now: stopped (``diloco down``) or drained."""
        return self.instructions.leaving

    @property
    def data_partition(self) -> tuple[int, int]:
        """(slice, number of slices) of the data to train on now: as at start, until a
        ``diloco scale`` changes the number of active learners."""
        return self.instructions.data_partition or self.spec.data_partition(self.me.id)

    def track_data(self, position: DataPosition) -> None:
        """Save this data position with each checkpoint from now on (a loop that opened
        another slice of the data after the run was scaled)."""
        self.data_position = position

    # --------------------------------------------------------------------- starting

    def start(self) -> int:
        """Resume from this learner's newest checkpoint that verifies, else from the
        global weights (keeping the step count of the newest checkpoint it had); every
        process ends up with the same parameters, AdamW state and step.  Returns the step."""
        resume = ResumePoint(None)
        run_over = False
        initial = full_parameters(self.model, self.parameter_names, self.group)  # version 0, if it is the syncer's
        if self.group.is_storage_rank:
            if run_over := self._run_over():
                log.warning(
                    "the run ended before this learner started (every syncer finished; a queued job started late, "
                    "or the learner was given up): it trains nothing and leaves"
                )
            self.poller.initial = initial
            resume = self.checkpoints.resume_point(self.tokens_per_step, self._refused)
            self.progress.step, self.progress.tokens = resume.step, resume.tokens
            if resume.checkpoint is not None:
                self.progress.checkpoint_step = resume.step
            else:
                self.installs.wait_for_global_weights(self.heartbeats, lambda: self._stop_signalled)
        start = share(
            self.group,
            StartPoint(resume.step, resume.checkpoint is not None, self._stop_signalled, run_over),
            self._device,
        )
        self.progress.step = self.start_step = start.step
        self.context.pacing.start_at(start.step, self.instructions.sync_interval)
        self.installs.instructions = replace(self.instructions, stop=start.stop, drain=start.run_over)
        self.resumed_at_the_end = start.step >= self.total_steps
        checkpoint = resume.checkpoint
        if start.from_checkpoint:
            parameters = checkpoint.parameters if checkpoint else None
            install_parameters(self.model, parameters, self.parameter_names, self.group)
            optimizer_state = checkpoint.optimizer_state if checkpoint else None
            load_full_optimizer_state(self.model, self.optimizer, optimizer_state, self.group)
        else:
            bases = self.fragments.base if self.group.is_storage_rank else None
            install_parameters(self.model, bases, self.parameter_names, self.group)
        if self.data_position is not None:
            self.data_position.restore(checkpoint.meta.get("data") if checkpoint else None, start.step)
        self.progress.training_since = time.time()
        if self.group.is_storage_rank:
            self.poller.initial = None
            if not start.stop and not start.run_over:  # it reports how it left, at its finish
                self.heartbeats.beat(LearnerState.TRAINING)
        return start.step

    def _run_over(self) -> bool:
        """Every syncer shard's head says the run finished (a head not read is not)."""
        try:
            heads = [reader.head() for reader in self.poller.readers]
        except StorageError as error:
            log.warning("could not read the head to see whether the run is over: %s", error)
            return False
        return all(head is not None and head.finished for head in heads)

    @property
    def _device(self) -> torch.device:
        return self.installs.device

    # --------------------------------------------------------------------- the loop

    def after_step(
        self, loss: float | None = None, compute_seconds: float | None = None, tokens: int | None = None
    ) -> None:
        """After one inner optimizer step, on every process: the learner's duties, each
        when it is due."""
        tokens = self.tokens_per_step if tokens is None else tokens
        step = self.progress.count_step(loss, compute_seconds, tokens)
        storage = self.group.is_storage_rank
        if storage:
            self.fragments.count_step(tokens)
        for fragment in self.context.pacing.due(step, self.instructions.sync_interval):
            self._send(fragment)
        self._install(self.poller.take() if storage else None)
        if storage:
            self.poller.start_if_due(self.fragments.base_version, awaiting=self.fragments.awaiting_merge)
        if storage and self.heartbeats.due():
            self.heartbeats.beat()
            self._follow_chaos()
        if self.checkpoints.due(step):
            self._checkpoint()
        if storage and self.progress.log_due():
            log.info(self.progress.line(self.total_steps, self.fragments.base_version))

    def poll_now(self) -> dict[FragmentIndex, bool]:
        """Look for newer global weights now, on this thread, and install what was found
        (a single-process learner; the loop's polls run on the poller's thread).  Returns
        the fragments installed, each with whether its unsent work was kept."""
        poll = self.poller.look_now(self.fragments.base_version)
        return {p: how == Install.KEEP_UNSENT for p, how in enumerate(self._install(poll)) if how != Install.NONE}

    # ------------------------------------------------------------------- the duties

    def _send(self, fragment: FragmentIndex) -> None:
        """Every process: gather the fragment's full values; the storage rank sends them."""
        theta = full_parameters(self.model, self.fragment_list[fragment].parameter_names, self.group)
        self.context.pacing.sent(fragment, self.progress.step)
        if self.group.is_storage_rank:
            self.sends.send(fragment, theta, self.progress.step, self.progress.loss)

    def _install(self, poll: Poll | None) -> tuple[Install, ...]:
        """Every process: a finished look installed, the instructions shared (:class:`~.installs.Installs`)."""
        installs = self.installs.install(poll, self._stop_signalled)
        self.context.pacing.installed(installs, self.progress.step, self.instructions.sync_interval)
        return installs

    def _checkpoint(self) -> None:
        """Every process: a checkpoint of the learner as it is now."""
        data = self.data_position.state() if self.data_position is not None and self.group.is_storage_rank else None
        if self.checkpoints.save(self.progress.step, self.progress.tokens, data):
            self.progress.checkpoint_step = self.progress.step

    def _follow_chaos(self) -> None:
        """A chaos plan given to the running run: its outages of this region, from now."""
        spec = self.manifest.changed() if self.manifest else None
        if spec is not None and spec.run == self.spec.run and spec.chaos != self.spec.chaos:
            self.bucket.store.faults = spec.faults_of(self.me.region)
            self.spec = self.spec.model_copy(update={"chaos": spec.chaos})
            log.info("the run's chaos plan changed: this region's storage fails as it says from now on")

    def _refused(self, kind: str, key: str, reason: str) -> None:
        log.warning("refused %s %s: %s", kind, key, reason)
        self.refusals.record(kind, key, reason, time.time())

    # ---------------------------------------------------------------------- ending

    def failed(self) -> None:
        """Report that the training loop failed (storage rank; a failure to report is logged)."""
        if self.group.is_storage_rank:
            try:
                self.heartbeats.beat(LearnerState.FAILED, wait=DELIVERY_SECONDS_AT_STOP)
            except StorageError as error:
                log.warning("could not report the failure: %s", error)

    def finish(self, finished: bool | None = None) -> int:
        """Send what is left and deliver it, write the last checkpoint and heartbeat;
        returns the exit code.  ``finished`` defaults to whether the step count reached
        ``training.inner_steps`` or the run drained this learner."""
        if finished is None:
            finished = self.progress.step >= self.total_steps or self.drain_requested
        code = EXIT_FINISHED if finished else EXIT_STOPPED
        if finished:
            # the work since each fragment's last send must count too; a learner
            # restarted at its last step cannot know what the one before it delivered
            due = (False,) * len(self.fragment_list)
            if self.group.is_storage_rank:
                f = self.fragments
                due = tuple(
                    f.c_tokens[p] > f.sent_tokens[p] or (self.resumed_at_the_end and f.c_steps[p] > 0)
                    for p in f.c_steps
                )
            for fragment, left in enumerate(share(self.group, FinalSends(due), self._device).due):
                if left:
                    self._send(FragmentIndex(fragment))
            self._checkpoint()
        elif self.progress.step > self.start_step and not self.checkpoints.due(self.progress.step):
            # stopped (``diloco down``): a checkpoint where it stands, with what it sent, so
            # that ``diloco resume`` goes on from this step and trains nothing twice
            self._checkpoint()
        if self.group.is_storage_rank:
            code = self._deliver(finished, code)
        ended = "finished" if code == EXIT_FINISHED else "stopped" if code == EXIT_STOPPED else "not delivered"
        log.info("%s at step %d", ended, self.progress.step)
        return code

    def _deliver(self, finished: bool, code: int) -> int:
        patience = DELIVERY_SECONDS_AT_FINISH if finished else DELIVERY_SECONDS_AT_STOP
        outbox = self.sends.outbox
        payloads_delivered = outbox.wait_empty(patience)
        checkpoint_written = self.checkpoints.flush(patience)
        state = LearnerState.FINISHED if finished else LearnerState.STOPPED
        if finished and not (payloads_delivered and checkpoint_written):
            log.error(
                "after %.0f s, %d payloads are not delivered and the final checkpoint is %s; exiting so that the "
                "supervisor restarts this learner and it sends them again",
                patience,
                outbox.waiting,
                "written" if checkpoint_written else "not written",
            )
            state, code = LearnerState.FAILED, EXIT_UNDELIVERED
        elif not payloads_delivered:
            log.warning(
                "stopping with %d payloads not delivered after %.0f s: the next send of their fragments from the "
                "same base carries their work",
                outbox.waiting,
                patience,
            )
        try:
            self.heartbeats.beat(state, wait=patience)
            if code == EXIT_FINISHED:  # delivered and reported: only the last one can matter now
                self.bucket.prune_checkpoints(self.me.id, keep=1)
        except StorageError as error:
            log.warning("could not write the last heartbeat or tidy the checkpoints: %s", error)
        self.close()
        return code

    def close(self) -> None:
        """Stop the upload and poll threads (what is queued is dropped)."""
        if self.group.is_storage_rank:
            for duty in (self.sends, self.checkpoints, self.heartbeats, self.poller):
                duty.close()
