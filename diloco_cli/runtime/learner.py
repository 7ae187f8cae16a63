"""The learner process: train on its own shard, send fragments when due, install newer
global versions, heartbeat and checkpoint, never waiting for anyone.

Started by a launcher (``diloco _learner``), possibly under ``torchrun``; only rank 0
touches storage.  Storage I/O runs on background threads (the outbox uploads payloads,
a poll reads and verifies new global versions, heartbeats and checkpoints upload), but
tensors the model depends on (parameters, bases, residuals, counters) are read and
written by the training thread alone, in :meth:`Learner._train`'s loop: a finished poll
is installed there, and the next poll starts only after that, from the bases as they
now are.  Exit codes: 0 finished, 143 stopped by a signal, 75 finished but could not
deliver its last payloads (the supervisor restarts it and it sends them again from its
final checkpoint), anything else a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.core.fragments import fragments_due, fragments_of_model
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.checkpoint import encode_checkpoint, generator_state, restore_checkpoint, restore_generator
from diloco_cli.runtime.distributed import broadcast_control, broadcast_parameters, choose_device, join_process_group, leave_process_group
from diloco_cli.runtime.global_weights import Fetched, GlobalReader, Refusal, apply_fetch
from diloco_cli.runtime.learner_fragments import LearnerFragments
from diloco_cli.runtime.outbox import LatestUpload, OutgoingPayload, Outbox
from diloco_cli.store.run_spec import RunSpec
from diloco_cli.store.documents import Heartbeat, LearnerState, Refusals
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import PAYLOAD_KEY
from diloco_cli.store.metering import StorageCounters
from diloco_cli.training.data import TextSplit, load_text, random_batch
from diloco_cli.training.inner import InnerSchedule, inner_step, make_inner_optimizer

log = logging.getLogger("diloco.learner")

EXIT_FINISHED = 0
EXIT_UNDELIVERED = 75
EXIT_STOPPED = 143
SEQUENCE_PER_EPOCH = 1_000_000
LOG_EVERY_STEPS = 50
DELIVERY_SECONDS_AT_FINISH = 600.0
"""How long a finished learner keeps trying to deliver its last payloads."""
DELIVERY_SECONDS_AT_STOP = 20.0
STEP_TIME_SMOOTHING = 0.2
"""Weight of the newest step in the moving average of step time that heartbeats report
(the syncer's grace window reads it)."""


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
    refusals: list[Refusal] = field(default_factory=list)


def data_generator(seed: int, shard: int, rank: int, step: int) -> torch.Generator:
    """The generator of a learner's batches, independent for every (seed, shard, rank)
    and reproducible from any step a learner must restart at without its checkpoint."""
    state = np.random.SeedSequence([seed, shard, rank, step]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class Learner:
    """One learner process (one rank of it under torchrun)."""

    def __init__(self, spec: RunSpec, learner: LearnerId, secret: RunSecret) -> None:
        self.spec = spec
        self.recipe = spec.recipe
        self.me = spec.learner(learner)
        self.secret = secret
        self.stop_requested = False
        self.progress = Progress()

    # ----------------------------------------------------------------------- setup

    def _request_stop(self, signum: int, _frame: object) -> None:
        log.info("signal %d: finishing the step and the uploads in flight, then stopping", signum)
        self.stop_requested = True

    def _setup(self) -> None:
        training = self.recipe.training
        self.device = choose_device(training.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.group = join_process_group(self.device)
        if training.threads_per_learner:
            torch.set_num_threads(training.threads_per_learner)
        torch.manual_seed(training.seed)
        self.model = self.recipe.model.build().to(self.device)
        self.fragments = LearnerFragments(fragments_of_model(self.model, self.recipe.sync.num_fragments), dict(self.model.named_parameters()))
        self.optimizer = make_inner_optimizer(self.model, training.learning_rate, training.weight_decay, training.betas)
        self.schedule = InnerSchedule(training.learning_rate, training.warmup_steps, training.inner_steps, training.final_learning_rate_fraction)
        region = self.spec.region(self.me.region)
        if region.data_source:  # the region's own copy: data stays in its region
            text = load_text(region.data_source, region.data_storage_options)
        else:
            text = load_text(self.recipe.data.source, self.recipe.data.storage_options)
        shard = TextSplit.of(text, self.recipe.data.heldout_fraction, self.recipe.data.sequence_length).shard(self.me.shard, len(self.spec.learners))
        rank_size = len(shard) // self.group.world_size
        self.shard = shard[self.group.rank * rank_size : (self.group.rank + 1) * rank_size]
        if training.batch_size % self.group.world_size:
            raise ValueError(f"training.batch_size {training.batch_size} must divide among {self.group.world_size} processes")
        self.rank_batch = training.batch_size // self.group.world_size
        self.tokens_per_step = training.batch_size * self.recipe.data.sequence_length
        self.generator = data_generator(training.seed, self.me.shard, self.group.rank, 0)
        self.trained_model = self.model
        if self.group.distributed:
            self.trained_model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.group.is_storage_rank:
            self.bucket = self.spec.bucket(self.me.region, self.secret)
            self.reader = GlobalReader(self.bucket, self.secret, self.fragments.fragments)
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

    def _start(self) -> None:
        """Resume from this learner's newest checkpoint that verifies, else from the
        global weights (keeping the step count of the newest checkpoint it had)."""
        if self.group.is_storage_rank and not self._resume_from_checkpoint():
            while not self.fragments.installed and not self.stop_requested:
                self._heartbeat(LearnerState.WAITING)  # with what it refused: the syncer repairs it
                missing = {p: Version(-1) for p, v in self.fragments.base_version.items() if v < 0}
                try:
                    self._apply_poll(self._poll(missing, self.newest_head, self.resync_seen))
                except StorageError as error:
                    log.warning("looking for global weights failed: %s", error)
                if not self.fragments.installed:
                    time.sleep(self.recipe.training.poll_seconds)
        step = broadcast_control(self.group, [self.progress.step], self.device)[0]
        self.progress.step = step
        self.resumed_at_the_end = step >= self.recipe.training.inner_steps
        broadcast_parameters(self.group, list(self.model.parameters()))

    def _resume_from_checkpoint(self) -> bool:
        refused_steps = []
        for key in reversed(self.bucket.checkpoint_keys(self.me.id)):
            try:
                meta = restore_checkpoint(self.bucket.read_checkpoint(key), self.model, self.optimizer, self.fragments, self.secret)
            except (PayloadError, KeyError) as error:
                self._refused("checkpoint", key, str(error))
                try:
                    refused_steps.append(int(self.bucket.marker_meta(key)["step"]))
                except (PayloadError, KeyError, FileNotFoundError):
                    pass
                self.bucket.drop_checkpoint(key)
                continue
            self.progress.step, self.progress.tokens = int(meta["step"]), int(meta["tokens"])
            self.progress.checkpoint_step = self.progress.step
            restore_generator(self.generator, meta["generator"])
            log.info("resumed from checkpoint at step %d", self.progress.step)
            return True
        if refused_steps:  # keep the step count (and the schedule), not the weights
            step = max(refused_steps)
            self.progress.step, self.progress.tokens = step, step * self.tokens_per_step
            self.generator = data_generator(self.recipe.training.seed, self.me.shard, self.group.rank, step)
            log.warning("no checkpoint verifies; starting from the global weights at step %d", step)
        return False

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
            total_steps=self.recipe.training.inner_steps,
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
        self.sequence += 1
        sequence = self.epoch * SEQUENCE_PER_EPOCH + self.sequence
        f = self.fragments
        meta = {"learner": self.me.id, "step": self.progress.step, "loss": self.progress.loss, "sent_at": time.time()}
        base_version, c_steps, c_tokens = f.base_version[fragment], f.c_steps[fragment], f.c_tokens[fragment]
        payload = f.encode_delta(fragment, self.recipe.sync.learner_codec, self.secret, meta)
        self.progress.sends += 1
        marker = {"step": meta["step"], "loss": meta["loss"], "sent_at": meta["sent_at"], "base_version": base_version, "c_steps": c_steps, "c_tokens": c_tokens}
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
            poll.refusals.append(Refusal("head", "global/head.json", f"version {head.version} is older than version {newest_head} seen before: a replayed head"))
            return poll
        try:
            control = self.bucket.read_control(self.me.id)
        except PayloadError as error:
            poll.refusals.append(Refusal("control", f"control/{self.me.id}.json", str(error)))
            control = None
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

    def _apply_poll(self, poll: Poll) -> list[FragmentIndex]:
        """On the storage rank's training thread: apply what a poll fetched to the
        bases, check each fragment against the head and install it; returns the
        fragments installed."""
        for refusal in poll.refusals:
            self._refused(refusal.kind, refusal.key, refusal.reason)
        if poll.fetched is None:
            return []
        installed = []
        for fetch in poll.fetched.fragments:
            try:
                values = apply_fetch(fetch, self.fragments.names(fetch.fragment), self.fragments.base, self.secret)
            except PayloadError as error:
                self._refused("install", f"fragment {fetch.fragment} version {fetch.version}", str(error))
                self.needs_snapshot.add(fetch.fragment)
                continue
            self.fragments.install(fetch.fragment, fetch.version, values)
            self.needs_snapshot.discard(fetch.fragment)
            installed.append(fetch.fragment)
            log.info("installed fragment %d at version %d (checked against the head)", fetch.fragment, fetch.version)
        self.newest_head = max(self.newest_head, poll.fetched.head.version)
        if poll.resync_serial is not None and len(installed) == len(poll.fetched.fragments):
            self.resync_seen = poll.resync_serial
        self.progress.installs += bool(installed)
        return installed

    def _install(self, poll: Poll | None) -> None:
        """Install a finished poll on every rank: rank 0 applies and checks it, then the
        other ranks receive the installed parameters."""
        installed = self._apply_poll(poll) if poll is not None else []
        mask = [int(FragmentIndex(p) in installed) for p in range(len(self.fragments.fragments))]
        control = broadcast_control(self.group, [int(self.stop_requested), *mask], self.device)
        self.stop_requested = bool(control[0])
        chosen = [FragmentIndex(p) for p, flag in enumerate(control[1:]) if flag]
        parameters = dict(self.model.named_parameters())
        broadcast_parameters(self.group, [parameters[n] for p in chosen for n in self.fragments.names(p)])

    def _checkpoint(self) -> None:
        meta = {"step": self.progress.step, "tokens": self.progress.tokens, "generator": generator_state(self.generator), "learner": self.me.id}
        payload = encode_checkpoint(self.model, self.optimizer, self.fragments, self.secret, meta)
        self.checkpoints.submit(self.bucket.write_checkpoint, self.me.id, self.progress.step, payload)
        self.progress.checkpoint_step = self.progress.step

    def _report(self) -> None:
        """Heartbeat, checkpoint and log line, each when due."""
        training, p = self.recipe.training, self.progress
        now = time.monotonic()
        if now - self.last_beat >= training.heartbeat_seconds:
            self._heartbeat()
            self.last_beat = now
        if p.step % training.checkpoint_every_steps == 0 and p.step < training.inner_steps:
            self._checkpoint()
        if p.step % LOG_EVERY_STEPS == 0:
            versions = ", ".join(f"{k}:{v}" for k, v in sorted(self.fragments.base_version.items()))
            log.info("step %d/%d loss %.4f %.2f steps/s base versions %s", p.step, training.inner_steps, p.loss, 1 / p.step_seconds, versions)

    # ------------------------------------------------------------------------ loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self._setup()
        try:
            return self._train()
        except BaseException:
            if self.group.is_storage_rank:
                try:
                    self._heartbeat(LearnerState.FAILED, wait=DELIVERY_SECONDS_AT_STOP)
                except StorageError as error:
                    log.warning("could not report the failure: %s", error)
            raise
        finally:
            leave_process_group(self.group)

    def _inner_step(self) -> float:
        started = time.perf_counter()
        inputs, targets = random_batch(self.shard, self.rank_batch, self.recipe.data.sequence_length, self.generator)
        learning_rate = self.schedule.learning_rate(self.progress.step)
        loss = inner_step(self.trained_model, self.optimizer, inputs.to(self.device), targets.to(self.device), learning_rate, self.recipe.training.gradient_clip)
        p = self.progress
        p.step += 1
        p.tokens += self.tokens_per_step
        p.loss = loss
        seconds = time.perf_counter() - started
        p.compute_seconds += seconds
        w = STEP_TIME_SMOOTHING
        p.step_seconds = seconds if p.step_seconds is None else (1 - w) * p.step_seconds + w * seconds
        return loss

    def _train(self) -> int:
        """The loop, top to bottom: a step; sends due; install a finished poll; only then
        start the next poll; report."""
        sync, storage = self.recipe.sync, self.group.is_storage_rank
        self._start()
        self.progress.training_since = time.time()
        if storage:
            self._heartbeat(LearnerState.TRAINING)
        while self.progress.step < self.recipe.training.inner_steps and not self.stop_requested:
            self._inner_step()
            self.fragments.count_step(self.tokens_per_step)
            poll = None
            if storage:
                for fragment in fragments_due(self.progress.step, sync.sync_interval, sync.num_fragments):
                    self._send(fragment)
                poll = self._take_poll()
            self._install(poll)
            if storage:
                self._start_poll()
                self._report()
        return self._finish()

    def _finish(self) -> int:
        finished = self.progress.step >= self.recipe.training.inner_steps
        code = EXIT_FINISHED if finished else EXIT_STOPPED
        if self.group.is_storage_rank:
            if finished:
                # the work since each fragment's last send must count too; a learner
                # restarted at its last step cannot know what the one before it delivered
                f = self.fragments
                for fragment in f.c_steps:
                    if f.c_tokens[fragment] > f.sent_tokens[fragment] or (self.resumed_at_the_end and f.c_steps[fragment] > 0):
                        self._send(fragment)
                self._checkpoint()
            patience = DELIVERY_SECONDS_AT_FINISH if finished else DELIVERY_SECONDS_AT_STOP
            payloads_delivered = self.outbox.wait_empty(patience)
            checkpoint_written = self.checkpoints.flush(patience)
            state = LearnerState.FINISHED if finished else LearnerState.STOPPED
            if finished and not (payloads_delivered and checkpoint_written):
                log.error(
                    "after %.0f s, %d payloads are not delivered and the final checkpoint is %s; exiting so that the "
                    "supervisor restarts this learner and it sends them again", patience, self.outbox.waiting, "written" if checkpoint_written else "not written",
                )  # fmt: skip
                state, code = LearnerState.FAILED, EXIT_UNDELIVERED
            try:
                self._heartbeat(state, wait=patience)
                if code == EXIT_FINISHED:  # delivered and reported: only the last one can matter now
                    self.bucket.prune_checkpoints(self.me.id, keep=1)
            except StorageError as error:
                log.warning("could not write the last heartbeat or tidy the checkpoints: %s", error)
            for uploads in (self.outbox, self.checkpoints, self.beats):
                uploads.close()
            self.polls.shutdown(wait=True, cancel_futures=True)
        log.info("%s at step %d", "finished" if code == EXIT_FINISHED else "stopped" if code == EXIT_STOPPED else "not delivered", self.progress.step)
        return code
