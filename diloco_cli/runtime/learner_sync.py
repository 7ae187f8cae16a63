"""Everything a learner does besides training: send fragments when due, install newer
global versions, heartbeat and checkpoint, resume after a restart.

:class:`LearnerSync` wraps any training loop, the built-in one
(:mod:`diloco_cli.runtime.learner`) or a user's own (:func:`diloco_cli.join`): the loop
calls :meth:`LearnerSync.start` once, :meth:`LearnerSync.after_step` after every inner
optimizer step, and :meth:`LearnerSync.finish` at the end.  Under ``torchrun`` every
process of the learner calls them at the same points: sends, installs and checkpoints
are collectives (the full values of sharded parameters are gathered to rank 0 and
installed values scattered back), and only rank 0 touches storage.

Storage I/O runs on background threads (the outbox uploads payloads, a poll reads and
verifies new global versions, heartbeats and checkpoints upload), but tensors the model
depends on (parameters, bases, residuals, counters) are read and written by the training
thread alone, inside :meth:`after_step`: a finished poll is installed there, and the next
poll starts only after that, from the bases as they now are.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.core.fragments import fragments_due, fragments_of_model
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.checkpoint import Checkpoint, decode_checkpoint, encode_checkpoint
from diloco_cli.runtime.distributed import (
    ProcessGroup,
    broadcast_control,
    full_optimizer_state,
    full_parameters,
    install_parameters,
    load_full_optimizer_state,
)
from diloco_cli.runtime.global_weights import Fetched, GlobalReader, Refusal, apply_fetch
from diloco_cli.runtime.learner_fragments import LearnerFragments
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.runtime.outbox import LatestUpload, Outbox, OutgoingPayload
from diloco_cli.store.documents import ControlNote, Heartbeat, LearnerState, Refusals
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.region import PAYLOAD_KEY, SEQUENCE_PER_EPOCH
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.learner")

OVERWRITE, KEEP = 1, 2
"""How a fragment is installed into the parameters (broadcast to every process)."""
EXIT_FINISHED = 0
EXIT_UNDELIVERED = 75
EXIT_STOPPED = 143
LOG_EVERY_STEPS = 50
DELIVERY_SECONDS_AT_FINISH = 600.0
"""How long a finished learner keeps trying to deliver its last payloads."""
DELIVERY_SECONDS_AT_STOP = 20.0
STEP_TIME_SMOOTHING = 0.2
"""Weight of the newest step in the moving average of step time that heartbeats report
(the syncer's grace window reads it)."""


class DataPosition(Protocol):
    """Where a training loop is in its data, saved with each checkpoint."""

    def state(self) -> str:
        """The position as text."""

    def restore(self, state: str | None, step: int) -> None:
        """Go back to a saved position; with ``None`` (no checkpoint, or not rank 0), to
        a position computed from the step alone."""


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_seconds: float | None = None
    compute_seconds: float = 0.0
    """Time spent in inner steps (forward, backward, optimizer) since this start."""
    sends: int = 0
    installs: int = 0
    checkpoint_step: int | None = None
    state: LearnerState = LearnerState.STARTING
    started_at: float = field(default_factory=time.time)
    training_since: float | None = None
    """When the loop's first step began (after setup and the first install)."""


@dataclass
class Poll:
    """What one look at the region's global objects found (made on the poll thread)."""

    fetched: Fetched | None = None
    resync_serial: int | None = None
    """The syncer's resync request this poll answers, if any."""
    control: ControlNote | None = None
    """The syncer's note to this learner, as this poll read it."""
    refusals: list[Refusal] = field(default_factory=list)


class LearnerSync:
    """A learner's membership in a run, around a model and its inner optimizer."""

    def __init__(
        self,
        spec: RunSpec,
        learner: LearnerId,
        secret: RunSecret,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group: ProcessGroup,
        tokens_per_step: int,
        data_position: DataPosition | None = None,
        manifest: ManifestWatch | None = None,
    ) -> None:
        self.spec, self.recipe, self.secret = spec, spec.recipe, secret
        self.me = spec.learner(learner)
        self.model, self.optimizer, self.group = model, optimizer, group
        self.tokens_per_step = tokens_per_step
        self.data_position = data_position
        self.manifest = manifest
        """The run's manifest, followed for a new chaos plan (``diloco chaos``)."""
        self.stop_requested = False
        self.drain_requested = False
        """The syncer told this learner to leave the run (``diloco scale``)."""
        self.partition: tuple[int, int] | None = None
        """The data slice the syncer assigned since the run was scaled (None: as at start)."""
        self.sync_interval = self.recipe.sync.sync_interval
        """H for this learner: the recipe's, or the syncer's H_m under dynamic local updates."""
        self.progress = Progress()
        self.fragment_list = fragments_of_model(model, self.recipe.sync.num_fragments)
        self.parameter_names = [name for fragment in self.fragment_list for name in fragment.parameter_names]
        if group.is_storage_rank:
            shapes = {name: parameter.shape for name, parameter in model.named_parameters()}
            self.fragments = LearnerFragments(self.fragment_list, shapes, keep_unsent=self.recipe.keeps_unsent_work)
            self.bucket = spec.bucket(self.me.region, secret)
            self.reader = GlobalReader(self.bucket, secret, self.fragment_list)
            self.refusals = Refusals()
            self.storage_before = StorageCounters()
            self.epoch = self._next_epoch()
            self.sequence = 0
            self.outbox = Outbox(self.bucket, self.me.id)
            self.polls = ThreadPoolExecutor(1, thread_name_prefix="poll")
            self.checkpoints = LatestUpload("checkpoint")
            self.beats = LatestUpload("heartbeat")
            self.poll: Future | None = None
            self.last_poll = self.last_beat = float("-inf")
            self.newest_head = Version(-1)
            self.resync_seen = 0
            self.needs_snapshot: set[FragmentIndex] = set()

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def total_steps(self) -> int:
        return self.recipe.training.inner_steps

    @property
    def leaving(self) -> bool:
        """Whether the loop should end now: stopped (``diloco down``) or drained."""
        return self.stop_requested or self.drain_requested

    @property
    def data_partition(self) -> tuple[int, int]:
        """(slice, number of slices) of the data to train on now: as at start, until a
        ``diloco scale`` changes the number of active learners."""
        return self.partition or self.spec.data_partition(self.me.id)

    def _next_epoch(self) -> int:
        """Count this start, above every epoch this learner may have used before (its
        epoch record, its last heartbeat, the payloads it left), so that send sequence
        numbers never repeat; what was refused is reported and skipped."""
        seen = [0]
        try:
            seen.append(self.bucket.read_epoch(self.me.id))
        except PayloadError as error:
            self._refused("epoch", f"control/{self.me.id}.epoch", str(error))
        try:
            previous = self.bucket.read_heartbeat(self.me.id)
        except PayloadError as error:
            self._refused("heartbeat", f"heartbeats/{self.me.id}.json", str(error))
            previous = None
        if previous is not None:
            seen.append(previous.epoch)
            self.storage_before, self.refusals = previous.storage, previous.refusals.plus(self.refusals)
        keys = [k for k in self.bucket.store.list_marked(f"payloads/{self.me.id}") if PAYLOAD_KEY.match(k)]
        keys.sort(key=lambda k: int(PAYLOAD_KEY.match(k)["sequence"]), reverse=True)
        for key in keys:  # the newest payload whose marker verifies (junk and forgeries skipped)
            try:
                seen.append(self.bucket.payload_record(key).sequence // SEQUENCE_PER_EPOCH)
                break
            except PayloadError as error:
                self._refused("marker", key, str(error))
            except FileNotFoundError:
                continue
        epoch = max(seen) + 1
        self.bucket.write_epoch(self.me.id, epoch)
        return epoch

    def _refused(self, kind: str, key: str, reason: str) -> None:
        log.warning("refused %s %s: %s", kind, key, reason)
        self.refusals.record(kind, key, reason, time.time())

    # ------------------------------------------------------------------- resuming

    def start(self) -> int:
        """Resume from this learner's newest checkpoint that verifies, else from the
        global weights (keeping the step count of the newest checkpoint it had); every
        process ends up with the same parameters, AdamW state and step.  Returns the step."""
        checkpoint = None
        if self.group.is_storage_rank:
            checkpoint = self._newest_checkpoint()
            if checkpoint is None:
                self._wait_for_global_weights()
        step, from_checkpoint = broadcast_control(
            self.group, [self.progress.step, int(checkpoint is not None)], self._device
        )
        self.progress.step = step
        self.resumed_at_the_end = step >= self.total_steps
        if from_checkpoint:
            install_parameters(
                self.model, checkpoint.parameters if checkpoint else None, self.parameter_names, self.group
            )
            load_full_optimizer_state(
                self.model, self.optimizer, checkpoint.optimizer_state if checkpoint else None, self.group
            )
        else:
            install_parameters(
                self.model,
                self.fragments.base if self.group.is_storage_rank else None,
                self.parameter_names,
                self.group,
            )
        if self.data_position is not None:
            self.data_position.restore(checkpoint.meta.get("data") if checkpoint else None, step)
        self.progress.training_since = time.time()
        if self.group.is_storage_rank:
            self._heartbeat(LearnerState.TRAINING)
        return step

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _newest_checkpoint(self) -> Checkpoint | None:
        refused_steps = []
        for key in reversed(self.bucket.checkpoint_keys(self.me.id)):
            try:
                checkpoint = decode_checkpoint(self.bucket.read_checkpoint(key), self.fragments, self.secret)
            except (PayloadError, KeyError) as error:
                self._refused("checkpoint", key, str(error))
                try:
                    refused_steps.append(int(self.bucket.marker_meta(key)["step"]))
                except (PayloadError, KeyError, FileNotFoundError):
                    pass
                self.bucket.drop_checkpoint(key)
                continue
            self.progress.step, self.progress.tokens = int(checkpoint.meta["step"]), int(checkpoint.meta["tokens"])
            self.progress.checkpoint_step = self.progress.step
            log.info("resumed from checkpoint at step %d", self.progress.step)
            return checkpoint
        if refused_steps:  # keep the step count (and the schedule), not the weights
            step = max(refused_steps)
            self.progress.step, self.progress.tokens = step, step * self.tokens_per_step
            log.warning("no checkpoint verifies; starting from the global weights at step %d", step)
        return None

    def _wait_for_global_weights(self) -> None:
        while not self.fragments.installed and not self.stop_requested:
            self._heartbeat(LearnerState.WAITING)  # with what it refused: the syncer repairs it
            missing = {p: Version(-1) for p, v in self.fragments.base_version.items() if v < 0}
            try:
                self._apply_poll(self._poll(missing, self.newest_head, self.resync_seen))
            except StorageError as error:
                log.warning("looking for global weights failed: %s", error)
            if not self.fragments.installed:
                time.sleep(self.recipe.training.poll_seconds)

    # --------------------------------------------------------------------- the loop

    def after_step(
        self, loss: float | None = None, compute_seconds: float | None = None, tokens: int | None = None
    ) -> None:
        """After one inner optimizer step, on every process: count it, send the fragments
        now due, install a finished poll (only then start the next one), report."""
        p = self.progress
        p.step += 1
        p.tokens += tokens if tokens is not None else self.tokens_per_step
        p.loss = loss
        if compute_seconds is not None:
            p.compute_seconds += compute_seconds
            w = STEP_TIME_SMOOTHING
            p.step_seconds = (
                compute_seconds if p.step_seconds is None else (1 - w) * p.step_seconds + w * compute_seconds
            )
        storage = self.group.is_storage_rank
        if storage:
            self.fragments.count_step(tokens if tokens is not None else self.tokens_per_step)
        sync = self.recipe.sync
        for fragment in fragments_due(p.step, self.sync_interval, sync.num_fragments):
            self._send(fragment)
        self._install(self._take_poll() if storage else None)
        if storage:
            self._start_poll()
            self._report()
        elif p.step % self.recipe.training.checkpoint_every_steps == 0 and p.step < self.total_steps:
            self._checkpoint()  # a collective: the storage rank gathers the state to write it

    # --------------------------------------------------------------------- storage

    def _heartbeat(self, state: LearnerState | None = None, wait: float = 0.0) -> None:
        """Write a heartbeat (the newest replaces one still waiting); with ``wait``, for
        up to that many seconds until it is written."""
        if state:
            self.progress.state = state
        p = self.progress
        beat = Heartbeat(
            learner=self.me.id,
            region=self.me.region,
            host=self.me.host,
            pid=os.getpid(),
            processes=self.group.world_size,
            state=p.state,
            step=p.step,
            total_steps=self.total_steps,
            tokens=p.tokens,
            loss=p.loss if p.loss is not None and np.isfinite(p.loss) else None,
            step_seconds=p.step_seconds,
            compute_seconds=p.compute_seconds,
            base_versions=dict(self.fragments.base_version),
            sends=p.sends,
            delivered=self.outbox.delivered,
            unsent=self.outbox.waiting,
            installs=p.installs,
            tokens_overwritten=dict(self.fragments.tokens_overwritten),
            checkpoint_step=p.checkpoint_step,
            restarts=self.epoch - 1,
            epoch=self.epoch,
            storage=self.storage_before.plus(self.bucket.store.meter.snapshot()),
            refusals=self.refusals.model_copy(deep=True),
            started_at=p.started_at,
            training_since=p.training_since,
            time=time.time(),
        )
        self.beats.submit(self.bucket.write_heartbeat, beat)
        if wait and not self.beats.flush(wait):
            raise StorageError(f"the heartbeat of {self.me.id} could not be written in {wait:.0f} s")

    def _send(self, fragment: FragmentIndex) -> None:
        """Every process: gather the fragment's full values; the storage rank encodes the
        delta and queues it."""
        theta = full_parameters(self.model, self.fragment_list[fragment].parameter_names, self.group)
        if not self.group.is_storage_rank:
            return
        self.sequence += 1
        sequence = self.epoch * SEQUENCE_PER_EPOCH + self.sequence
        f = self.fragments
        meta = {"learner": self.me.id, "step": self.progress.step, "loss": self.progress.loss, "sent_at": time.time()}
        base_version, c_steps, c_tokens = f.base_version[fragment], f.c_steps[fragment], f.c_tokens[fragment]
        payload = f.encode_delta(fragment, theta, self.recipe.sync.learner_codec, self.secret, meta)
        self.progress.sends += 1
        marker = {
            "step": meta["step"],
            "loss": meta["loss"],
            "sent_at": meta["sent_at"],
            "base_version": base_version,
            "c_steps": c_steps,
            "c_tokens": c_tokens,
        }
        self.outbox.put(OutgoingPayload(fragment, sequence, base_version, f.install_serial[fragment], payload, marker))

    def _poll(self, bases: dict[FragmentIndex, Version], newest_head: Version, resync_seen: int) -> Poll:
        """Runs on the poll thread (or at start): read the head and the syncer's note,
        fetch and verify whatever brings ``bases`` up to the head.  Touches none of the
        learner's state: its arguments are copies made by the training thread."""
        poll = Poll()
        try:
            head = self.reader.head()
        except PayloadError as error:
            poll.refusals.append(Refusal("head", "global/head.json", str(error)))
            return poll
        if head is None:
            return poll
        if head.version < newest_head:
            poll.refusals.append(
                Refusal(
                    "head",
                    "global/head.json",
                    f"version {head.version} is older than version {newest_head} seen before: a replayed head",
                )
            )
            return poll
        try:
            control = self.bucket.read_control(self.me.id)
        except PayloadError as error:
            poll.refusals.append(Refusal("control", f"control/{self.me.id}.json", str(error)))
            control = None
        poll.control = control
        if control is not None and control.resync_serial > resync_seen:
            poll.resync_serial = control.resync_serial
            due = {p: Version(-1) for p in head.fragment_versions}
        else:
            due = {p: base for p, base in bases.items() if head.fragment_versions.get(p, Version(0)) > base}
        poll.fetched = self.reader.fetch(head, due)
        poll.refusals += poll.fetched.refusals
        return poll

    def _take_poll(self) -> Poll | None:
        """The poll that finished since the last look, if one did."""
        if self.poll is None or not self.poll.done():
            return None
        future, self.poll = self.poll, None
        try:
            return future.result()
        except StorageError as error:
            log.warning("looking for global weights failed: %s", error)
            return None

    def _start_poll(self) -> None:
        """Look for newer global weights, from the bases as they are now (every install
        so far applied: the training thread calls this only after installing)."""
        now = time.monotonic()
        if self.poll is None and now - self.last_poll >= self.recipe.training.poll_seconds:
            bases = {p: Version(-1) if p in self.needs_snapshot else v for p, v in self.fragments.base_version.items()}
            self.poll = self.polls.submit(self._poll, bases, self.newest_head, self.resync_seen)
            self.last_poll = now

    # ----------------------------------------------------------------- installation

    def _apply_poll(self, poll: Poll) -> dict[FragmentIndex, bool]:
        """On the storage rank's training thread: apply what a poll fetched to the
        bases, check each fragment against the head and make it the base; returns the
        fragments whose base changed, each with whether its unsent work is kept (the
        caller installs them into the parameters).  A resync never keeps it."""
        for refusal in poll.refusals:
            self._refused(refusal.kind, refusal.key, refusal.reason)
        if poll.control is not None:
            self._follow_note(poll.control)
        if poll.fetched is None:
            return {}
        installed: dict[FragmentIndex, bool] = {}
        for fetch in poll.fetched.fragments:
            try:
                values = apply_fetch(fetch, self.fragments.names(fetch.fragment), self.fragments.base, self.secret)
            except PayloadError as error:
                self._refused("install", f"fragment {fetch.fragment} version {fetch.version}", str(error))
                self.needs_snapshot.add(fetch.fragment)
                continue
            installed[fetch.fragment] = self.fragments.install(
                fetch.fragment, fetch.version, values, keep_unsent=False if poll.resync_serial is not None else None
            )
            self.needs_snapshot.discard(fetch.fragment)
            log.info("installed fragment %d at version %d (checked against the head)", fetch.fragment, fetch.version)
        self.newest_head = max(self.newest_head, poll.fetched.head.version)
        if poll.resync_serial is not None and len(installed) == len(poll.fetched.fragments):
            self.resync_seen = poll.resync_serial
        self.progress.installs += bool(installed)
        return installed

    def _follow_note(self, note: ControlNote) -> None:
        """Drain, or train on another slice of the data, when the syncer's note says so."""
        if note.drain and not self.drain_requested:
            log.info("the run drains this learner: sending what it trained, then stopping")
            self.drain_requested = True
        interval = note.sync_interval or self.recipe.sync.sync_interval
        if interval != self.sync_interval:
            log.info(
                "sending every %d steps now (dynamic local updates; the recipe's H is %d)",
                interval,
                self.recipe.sync.sync_interval,
            )
            self.sync_interval = interval
        partition = (note.data_slice, note.data_slices) if note.data_slices and note.data_slice is not None else None
        if partition is not None and partition != self.partition:
            log.info("the run was scaled: training on slice %d of %d of the data now", *partition)
            self.partition = partition

    def _install(self, poll: Poll | None) -> None:
        """Every process: the storage rank applies and checks a finished poll, then the
        new bases overwrite the parameters of every process (and the stop flag travels)."""
        installed = self._apply_poll(poll) if poll is not None else {}
        mask = [
            0 if p not in installed else KEEP if installed[p] else OVERWRITE for p in range(len(self.fragment_list))
        ]
        partition = self.partition or (-1, 0)
        control = broadcast_control(
            self.group,
            [int(self.stop_requested), int(self.drain_requested), self.sync_interval, *partition, *mask],
            self._device,
        )
        self.stop_requested, self.drain_requested, self.sync_interval = bool(control[0]), bool(control[1]), control[2]
        self.partition = (control[3], control[4]) if control[4] else None
        how_installed = control[5:]
        overwritten = [
            n for p, how in enumerate(how_installed) if how == OVERWRITE for n in self.fragment_list[p].parameter_names
        ]
        kept = [n for p, how in enumerate(how_installed) if how == KEEP for n in self.fragment_list[p].parameter_names]
        storage = self.group.is_storage_rank
        if overwritten:
            install_parameters(self.model, self.fragments.base if storage else None, overwritten, self.group)
        if kept:  # the global version plus the work not sent yet
            theta = full_parameters(self.model, kept, self.group)
            install_parameters(
                self.model, self.fragments.with_unsent(kept, theta) if storage else None, kept, self.group
            )

    def _checkpoint(self) -> None:
        """Every process: gather parameters and AdamW state; the storage rank writes them."""
        parameters = full_parameters(self.model, self.parameter_names, self.group)
        optimizer_state = full_optimizer_state(self.model, self.optimizer, self.group)
        if not self.group.is_storage_rank:
            return
        meta = {"step": self.progress.step, "tokens": self.progress.tokens, "learner": self.me.id}
        if self.data_position is not None:
            meta["data"] = self.data_position.state()
        payload = encode_checkpoint(parameters, optimizer_state, self.fragments, self.secret, meta)
        self.checkpoints.submit(self.bucket.write_checkpoint, self.me.id, self.progress.step, payload)
        self.progress.checkpoint_step = self.progress.step

    def _follow_chaos(self) -> None:
        """A chaos plan given to the running run: its outages of this region, from now."""
        spec = self.manifest.changed() if self.manifest else None
        if spec is not None and spec.run == self.spec.run and spec.chaos != self.spec.chaos:
            self.bucket.store.faults = spec.faults_of(self.me.region)
            self.spec = self.spec.model_copy(update={"chaos": spec.chaos})
            log.info("the run's chaos plan changed: this region's storage fails as it says from now on")

    def _report(self) -> None:
        """Heartbeat, checkpoint and log line, each when due."""
        training, p = self.recipe.training, self.progress
        now = time.monotonic()
        if now - self.last_beat >= training.heartbeat_seconds:
            self._heartbeat()
            self.last_beat = now
            self._follow_chaos()
        if p.step % training.checkpoint_every_steps == 0 and p.step < training.inner_steps:
            self._checkpoint()
        if p.step % LOG_EVERY_STEPS == 0:
            versions = ", ".join(f"{k}:{v}" for k, v in sorted(self.fragments.base_version.items()))
            speed = f"{1 / p.step_seconds:.2f} steps/s " if p.step_seconds else ""
            loss = f"loss {p.loss:.4f} " if p.loss is not None else ""
            log.info("step %d/%d %s%sbase versions %s", p.step, training.inner_steps, loss, speed, versions)

    # ---------------------------------------------------------------------- ending

    def failed(self) -> None:
        """Report that the training loop failed (storage rank; a failure to report is logged)."""
        if self.group.is_storage_rank:
            try:
                self._heartbeat(LearnerState.FAILED, wait=DELIVERY_SECONDS_AT_STOP)
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
            mask = [0] * len(self.fragment_list)
            if self.group.is_storage_rank:
                f = self.fragments
                mask = [
                    int(f.c_tokens[p] > f.sent_tokens[p] or (self.resumed_at_the_end and f.c_steps[p] > 0))
                    for p in f.c_steps
                ]
            for fragment, due in enumerate(broadcast_control(self.group, mask, self._device)):
                if due:
                    self._send(FragmentIndex(fragment))
            self._checkpoint()
        if self.group.is_storage_rank:
            code = self._deliver(finished, code)
        log.info(
            "%s at step %d",
            "finished" if code == EXIT_FINISHED else "stopped" if code == EXIT_STOPPED else "not delivered",
            self.progress.step,
        )
        return code

    def _deliver(self, finished: bool, code: int) -> int:
        patience = DELIVERY_SECONDS_AT_FINISH if finished else DELIVERY_SECONDS_AT_STOP
        payloads_delivered = self.outbox.wait_empty(patience)
        checkpoint_written = self.checkpoints.flush(patience)
        state = LearnerState.FINISHED if finished else LearnerState.STOPPED
        if finished and not (payloads_delivered and checkpoint_written):
            log.error(
                "after %.0f s, %d payloads are not delivered and the final checkpoint is %s; exiting so that the "
                "supervisor restarts this learner and it sends them again",
                patience,
                self.outbox.waiting,
                "written" if checkpoint_written else "not written",
            )
            state, code = LearnerState.FAILED, EXIT_UNDELIVERED
        try:
            self._heartbeat(state, wait=patience)
            if code == EXIT_FINISHED:  # delivered and reported: only the last one can matter now
                self.bucket.prune_checkpoints(self.me.id, keep=1)
        except StorageError as error:
            log.warning("could not write the last heartbeat or tidy the checkpoints: %s", error)
        self.close()
        return code

    def close(self) -> None:
        """Stop the upload and poll threads (what is queued is dropped)."""
        if self.group.is_storage_rank:
            for uploads in (self.outbox, self.checkpoints, self.beats):
                uploads.close()
            self.polls.shutdown(wait=True, cancel_futures=True)
