"""The learner process: train on its own shard, send fragments when due, install newer
global versions, heartbeat and checkpoint, never waiting for anyone.

Started by a launcher (``diloco _learner``), possibly under ``torchrun``; only rank 0
touches storage, and storage I/O runs on background threads so training never blocks
on a bucket.  Exit codes: 0 finished, 143 stopped by a signal (the supervisor restarts
it unless it was told to stop), anything else a failure.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.core.fragments import fragments_due, fragments_of_model
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.checkpoint import encode_checkpoint, generator_state, restore_checkpoint, restore_generator
from diloco_cli.runtime.distributed import (
    broadcast_control,
    broadcast_parameters,
    choose_device,
    join_process_group,
    leave_process_group,
)
from diloco_cli.runtime.global_weights import GlobalWeights, Head
from diloco_cli.runtime.learner_fragments import LearnerFragments
from diloco_cli.runtime.run_spec import RunSpec
from diloco_cli.training.data import TextSplit, load_text, random_batch
from diloco_cli.training.inner import InnerSchedule, inner_step, make_inner_optimizer

log = logging.getLogger("diloco.learner")

EXIT_FINISHED = 0
EXIT_STOPPED = 143
SEQUENCE_PER_EPOCH = 1_000_000
LOG_EVERY_STEPS = 50


@dataclass
class Install:
    """Global fragments fetched by the I/O thread, ready to install."""

    versions: dict[FragmentIndex, Version]
    tensors: dict[str, torch.Tensor]
    resync: bool = False


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_seconds: float | None = None
    sends: int = 0
    installs: int = 0
    checkpoint_step: int | None = None
    state: str = "starting"
    started_at: float = field(default_factory=time.time)


def _retrying(action, *, attempts: int = 5, first_delay: float = 0.5):
    """Run a storage action, retrying transient failures with exponential backoff."""
    delay = first_delay
    for attempt in range(attempts):
        try:
            return action()
        except (OSError, TimeoutError) as error:  # network and filesystem hiccups
            if attempt == attempts - 1:
                raise
            log.warning("storage call failed (%s); retrying in %.1f s", error, delay)
            time.sleep(delay)
            delay *= 2
    return None


class Learner:
    """One learner process (one rank of it under torchrun)."""

    def __init__(self, spec: RunSpec, learner: LearnerId, secret: RunSecret, restarts: int = 0) -> None:
        self.spec = spec
        self.recipe = spec.recipe
        self.me = spec.learner(learner)
        self.secret = secret
        self.restarts = restarts
        self.stop_requested = False
        self.progress = Progress()

    # ----------------------------------------------------------------------- setup

    def _request_stop(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: finishing the step and the upload in flight, then stopping", signum)
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
        self.generator = torch.Generator().manual_seed(training.seed * 7919 + self.me.shard * 104729 + self.group.rank)
        self.trained_model = self.model
        if self.group.distributed:
            self.trained_model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.group.is_storage_rank:
            self.bucket = self.spec.bucket(self.me.region, self.secret)
            self.global_weights = GlobalWeights(self.bucket, self.secret)
            self.epoch = _retrying(lambda: self.bucket.next_epoch(self.me.id))
            self.sequence = 0
            self.uploads = ThreadPoolExecutor(1, thread_name_prefix="upload")
            self.fetches = ThreadPoolExecutor(1, thread_name_prefix="fetch")
            self.beats = ThreadPoolExecutor(1, thread_name_prefix="heartbeat")
            self.pending_uploads: list[Future] = []

    # --------------------------------------------------------------------- storage

    def _heartbeat(self, state: str | None = None, wait: bool = False) -> None:
        if state:
            self.progress.state = state
        p = self.progress
        beat = {
            "learner": self.me.id,
            "region": self.me.region,
            "host": self.me.host,
            "pid": os.getpid(),
            "processes": self.group.world_size,
            "state": p.state,
            "step": p.step,
            "total_steps": self.recipe.training.inner_steps,
            "tokens": p.tokens,
            "loss": p.loss,
            "step_seconds": p.step_seconds,
            "base_versions": {str(k): v for k, v in self.fragments.base_version.items()},
            "sends": p.sends,
            "installs": p.installs,
            "checkpoint_step": p.checkpoint_step,
            "restarts": self.restarts,
            "epoch": self.epoch,
            "bytes_up": self.bucket.store.bytes.up,
            "bytes_down": self.bucket.store.bytes.down,
            "started_at": p.started_at,
            "time": time.time(),
        }
        future = self.beats.submit(_retrying, lambda: self.bucket.write_heartbeat(self.me.id, beat))
        if wait:
            future.result()

    def _send(self, fragment: FragmentIndex) -> None:
        self.sequence += 1
        sequence = self.epoch * SEQUENCE_PER_EPOCH + self.sequence
        meta = {"learner": self.me.id, "step": self.progress.step, "loss": self.progress.loss, "sent_at": time.time()}
        payload = self.fragments.encode_delta(fragment, self.recipe.sync.learner_codec, self.secret, meta)
        self.progress.sends += 1
        upload_meta = {k: meta[k] for k in ("step", "loss", "sent_at")} | {
            "base_version": self.fragments.base_version[fragment],
            "c_steps": self.fragments.c_steps[fragment],
            "c_tokens": self.fragments.c_tokens[fragment],
        }
        self.pending_uploads = [f for f in self.pending_uploads if not f.done()]
        self.pending_uploads.append(
            self.uploads.submit(_retrying, lambda: self.bucket.send_payload(self.me.id, fragment, sequence, payload, upload_meta))
        )

    def _fetch_install(self, base_versions: dict[FragmentIndex, Version], resync_seen: int) -> Install | None:
        """Runs on the fetch thread: what newer global fragments there are, fetched and
        applied to copies of the bases (exactly as the syncer holds them)."""
        head = self.global_weights.head()
        if head is None:
            return None
        control = self.bucket.read_control(self.me.id)
        resync = int(control.get("resync_serial", 0)) > resync_seen
        due = [p for p, v in head.fragment_versions.items() if v > base_versions.get(p, Version(-1))]
        if resync:
            due = sorted(head.fragment_versions)
        if not due:
            return None
        updates = {p: head.updates_after(p, base_versions.get(p, Version(-1))) for p in due}
        if resync or any(versions is None for versions in updates.values()):
            return self._fetch_snapshot(head, resync)
        tensors, versions = {}, {}
        for p in due:
            names = self.fragments.names(p)
            copies = {name: self.fragments.base[name].clone() for name in names}
            self.global_weights.apply_updates(copies, p, updates[p])
            tensors.update(copies)
            versions[p] = head.fragment_versions[p]
        return Install(versions, tensors)

    def _fetch_snapshot(self, head: Head, resync: bool = False) -> Install:
        names = {f.index: f.parameter_names for f in self.fragments.fragments}
        parameters = self.global_weights.snapshot(head.snapshot_version)
        for p, fragment_names in names.items():
            self.global_weights.apply_updates({n: parameters[n] for n in fragment_names}, p, head.updates_after(p, head.snapshot_version) or [])
        versions = {p: head.fragment_versions.get(p, head.snapshot_version) for p in names}
        return Install(versions, {name: parameters[name] for name in self.fragments.base}, resync=resync)

    # ----------------------------------------------------------------- installation

    def _apply_install(self, install: Install | None) -> None:
        """Install fetched fragments on every rank (rank 0 decides, others follow)."""
        fragment_count = len(self.fragments.fragments)
        mask = [0] * fragment_count
        if install is not None:
            for p in install.versions:
                mask[p] = 1
        control = broadcast_control(self.group, [int(self.stop_requested), *mask], self.device)
        self.stop_requested = bool(control[0])
        chosen = [FragmentIndex(p) for p, flag in enumerate(control[1:]) if flag]
        if not chosen:
            return
        if self.group.is_storage_rank and install is not None:
            for p in chosen:
                for name in self.fragments.names(p):
                    self.fragments.base[name].copy_(install.tensors[name])
                self.fragments.install(p, install.versions[p])
            self.progress.installs += 1
        parameters = dict(self.model.named_parameters())
        broadcast_parameters(self.group, [parameters[n] for p in chosen for n in self.fragments.names(p)])

    def _start(self) -> None:
        """Resume from this learner's checkpoint, else from the newest global weights."""
        if self.group.is_storage_rank:
            checkpoint = _retrying(lambda: self.bucket.latest_checkpoint(self.me.id))
            if checkpoint is not None:
                try:
                    meta = restore_checkpoint(checkpoint, self.model, self.optimizer, self.fragments, self.secret)
                    self.progress.step, self.progress.tokens = int(meta["step"]), int(meta["tokens"])
                    self.progress.checkpoint_step = self.progress.step
                    restore_generator(self.generator, meta["generator"])
                    log.info("resumed from checkpoint at step %d", self.progress.step)
                except (PayloadError, KeyError) as error:
                    log.warning("checkpoint refused (%s); starting from the global weights", error)
                    checkpoint = None
            if checkpoint is None:
                self._heartbeat("waiting")
                install = None
                while install is None and not self.stop_requested:
                    head = _retrying(self.global_weights.head)
                    if head is not None:
                        install = self._fetch_snapshot(head)
                    else:
                        time.sleep(self.recipe.training.poll_seconds)
                if install is not None:
                    for name, tensor in install.tensors.items():
                        self.fragments.base[name].copy_(tensor)
                    for p, version in install.versions.items():
                        self.fragments.install(p, version)
        step = broadcast_control(self.group, [self.progress.step], self.device)[0]
        self.progress.step = step
        broadcast_parameters(self.group, list(self.model.parameters()))

    def _checkpoint(self) -> None:
        meta = {
            "step": self.progress.step,
            "tokens": self.progress.tokens,
            "generator": generator_state(self.generator),
            "learner": self.me.id,
        }
        payload = encode_checkpoint(self.model, self.optimizer, self.fragments, self.secret, meta)
        step = self.progress.step
        self.progress.checkpoint_step = step
        self.pending_uploads.append(self.uploads.submit(_retrying, lambda: self.bucket.write_checkpoint(self.me.id, step, payload)))

    # ------------------------------------------------------------------------ loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self._setup()
        try:
            return self._train()
        except BaseException:
            if self.group.is_storage_rank:
                self._heartbeat("failed", wait=True)
            raise
        finally:
            leave_process_group(self.group)

    def _train(self) -> int:
        training, sync = self.recipe.training, self.recipe.sync
        storage = self.group.is_storage_rank
        self._start()
        if storage:
            self._heartbeat("training")
        tokens_per_step = training.batch_size * self.recipe.data.sequence_length
        poll: Future | None = None
        resync_seen = 0
        last_poll = last_beat = time.monotonic()
        while self.progress.step < training.inner_steps and not self.stop_requested:
            started = time.perf_counter()
            inputs, targets = random_batch(self.shard, self.rank_batch, self.recipe.data.sequence_length, self.generator)
            learning_rate = self.schedule.learning_rate(self.progress.step)
            loss = inner_step(self.trained_model, self.optimizer, inputs.to(self.device), targets.to(self.device), learning_rate, training.gradient_clip)
            self.progress.step += 1
            self.progress.tokens += tokens_per_step
            self.progress.loss = loss
            seconds = time.perf_counter() - started
            p = self.progress
            p.step_seconds = seconds if p.step_seconds is None else 0.8 * p.step_seconds + 0.2 * seconds
            install = None
            if storage:
                self.fragments.count_step(tokens_per_step)
                for fragment in fragments_due(p.step, sync.sync_interval, sync.num_fragments):
                    self._send(fragment)
                now = time.monotonic()
                if poll is not None and poll.done():
                    try:
                        install = poll.result()
                    except (OSError, PayloadError, TimeoutError) as error:
                        log.warning("fetching global weights failed: %s", error)
                    if install is not None and install.resync:
                        resync_seen = int(self.bucket.read_control(self.me.id).get("resync_serial", 0))
                    poll = None
                if poll is None and now - last_poll >= training.poll_seconds:
                    versions = dict(self.fragments.base_version)
                    poll = self.fetches.submit(self._fetch_install, versions, resync_seen)
                    last_poll = now
                if now - last_beat >= training.heartbeat_seconds:
                    self._heartbeat()
                    last_beat = now
                if p.step % training.checkpoint_every_steps == 0 and p.step < training.inner_steps:
                    self._checkpoint()
                if p.step % LOG_EVERY_STEPS == 0:
                    versions = ", ".join(f"{k}:{v}" for k, v in sorted(self.fragments.base_version.items()))
                    log.info("step %d/%d loss %.4f %.2f steps/s base versions %s", p.step, training.inner_steps, loss, 1 / p.step_seconds, versions)
            else:
                self.fragments.count_step(tokens_per_step)
            self._apply_install(install)
        return self._finish()

    def _finish(self) -> int:
        finished = self.progress.step >= self.recipe.training.inner_steps
        if self.group.is_storage_rank:
            if finished:
                # the work since each fragment's last send must count too
                sync = self.recipe.sync
                just_sent = set(fragments_due(self.progress.step, sync.sync_interval, sync.num_fragments))
                for fragment in self.fragments.c_steps:
                    if self.fragments.c_steps[fragment] > 0 and fragment not in just_sent:
                        self._send(fragment)
                self._checkpoint()
            for future in self.pending_uploads:
                future.result()
            self._heartbeat("finished" if finished else "stopped", wait=True)
            for executor in (self.uploads, self.fetches, self.beats):
                executor.shutdown(wait=True, cancel_futures=True)
        log.info("%s at step %d", "finished" if finished else "stopped", self.progress.step)
        return EXIT_FINISHED if finished else EXIT_STOPPED
