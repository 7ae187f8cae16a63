"""A learner's checkpoints: when it writes one, what it holds, where a start resumes.

A checkpoint is the learner's parameters, inner AdamW state, fragment bookkeeping and
data position, in one authenticated fp32 payload (never a pickle).  The storage rank
writes and reads it from full (unsharded) values: the parameters and the AdamW state
gathered from every process of the learner (:mod:`diloco_cli.runtime.distributed`), so a
checkpoint is the same whether the learner ran in one process, under DDP or FSDP.

:class:`Checkpoints` is the learner's duty: one every ``training.checkpoint_every_steps``
(:meth:`~Checkpoints.due`), the newest upload replacing one still waiting, and at the
start the newest checkpoint that verifies (:meth:`~Checkpoints.resume_point`); a damaged
one is dropped and the one before it tried, and when none verifies the learner keeps
the step count (and so its schedule) and starts from the global weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco_cli.codec import CodecSpec, PayloadError, RunSecret, decode_payload, encode_payload
from diloco_cli.runtime.distributed import ADAM_BUFFERS, full_optimizer_state, full_parameters
from diloco_cli.runtime.learner.context import LearnerContext, TrainedModel
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.runtime.learner.outbox import LatestUpload

log = logging.getLogger("diloco.learner")

CHECKPOINT_SPEC = CodecSpec(codec="fp32", zstd_level=1)

OptimizerState = Mapping[str, Mapping[str, Any]]
"""Per parameter name: AdamW's ``step`` (a number) and its buffers (full tensors)."""


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint restores (its fragment bookkeeping goes straight into the
    learner's :class:`LearnerFragments`)."""

    parameters: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, Any]]
    meta: dict[str, Any]


def encode_checkpoint(
    parameters: Mapping[str, torch.Tensor],
    optimizer_state: OptimizerState,
    fragments: LearnerFragments,
    secret: RunSecret,
    meta: Mapping[str, Any],
) -> bytes:
    tensors: dict[str, torch.Tensor] = {f"model/{name}": value.detach() for name, value in parameters.items()}
    adam_steps = {}
    for name, state in optimizer_state.items():
        adam_steps[name] = float(state["step"])
        for buffer in ADAM_BUFFERS:
            tensors[f"adam/{name}/{buffer}"] = state[buffer]
    tensors.update(fragments.state_tensors())
    full_meta = {**meta, "adam_steps": adam_steps, "fragments": fragments.state_meta()}
    return encode_payload(tensors.items(), CHECKPOINT_SPEC, secret, full_meta)


def decode_checkpoint(payload: bytes, fragments: LearnerFragments, secret: RunSecret) -> Checkpoint:
    """Verify a checkpoint and load its bookkeeping into ``fragments``; returns the rest."""
    decoded = decode_payload(payload, secret)
    tensors, meta = decoded.tensors, decoded.meta
    parameters = {name[len("model/") :]: tensor for name, tensor in tensors.items() if name.startswith("model/")}
    optimizer_state = {
        name: {"step": step, **{buffer: tensors[f"adam/{name}/{buffer}"] for buffer in ADAM_BUFFERS}}
        for name, step in meta["adam_steps"].items()
    }
    fragments.load_state(tensors, meta["fragments"])
    return Checkpoint(parameters, optimizer_state, meta)


@dataclass(frozen=True)
class ResumePoint:
    """Where a start resumes: a verified checkpoint (or None: from the global weights)
    and the step and tokens it had reached."""

    checkpoint: Checkpoint | None
    step: int = 0
    tokens: int = 0


class Checkpoints:
    """A learner's checkpoints: every process takes part in :meth:`save` (the state is
    gathered); the storage rank (the one with a bucket) writes them and finds the newest."""

    def __init__(self, context: LearnerContext, trained: TrainedModel) -> None:
        training = context.recipe.training
        self.every_steps, self.total_steps = training.checkpoint_every_steps, training.inner_steps
        self.model, self.optimizer, self.group = trained.model, trained.optimizer, context.group
        self.parameter_names = context.parameter_names
        self.secret, self.learner, self.bucket, self.fragments = (
            context.secret,
            context.me.id,
            context.bucket,
            context.fragments,
        )
        self._uploads = LatestUpload("checkpoint") if self.bucket is not None else None

    def due(self, step: int) -> bool:
        """Every ``every_steps`` while training (the last step's is written by finish)."""
        return step % self.every_steps == 0 and step < self.total_steps

    def save(self, step: int, tokens: int, data_state: str | None) -> bool:
        """Every process: gather parameters and AdamW state; the storage rank encodes them
        and queues the upload.  Returns whether this process queued one."""
        parameters = full_parameters(self.model, self.parameter_names, self.group)
        optimizer_state = full_optimizer_state(self.model, self.optimizer, self.group)
        if self._uploads is None:
            return False
        meta: dict[str, Any] = {"step": step, "tokens": tokens, "learner": self.learner}
        if data_state is not None:
            meta["data"] = data_state
        payload = encode_checkpoint(parameters, optimizer_state, self.fragments, self.secret, meta)
        self._uploads.submit(self.bucket.write_checkpoint, self.learner, step, payload)
        return True

    def resume_point(self, tokens_per_step: int, refused: Callable[[str, str, str], None]) -> ResumePoint:
        """Storage rank: the newest checkpoint that verifies (its bookkeeping loaded into
        the fragments).  Damaged ones are reported, dropped for good, and remembered for
        their step: when none verifies, the start keeps the step count of the newest."""
        refused_steps = []
        for key in reversed(self.bucket.checkpoint_keys(self.learner)):
            try:
                checkpoint = decode_checkpoint(self.bucket.read_checkpoint(key), self.fragments, self.secret)
            except (PayloadError, KeyError) as error:
                refused("checkpoint", key, str(error))
                try:
                    refused_steps.append(int(self.bucket.marker_meta(key)["step"]))
                except (PayloadError, KeyError, FileNotFoundError):
                    pass
                self.bucket.drop_checkpoint(key)
                continue
            step = int(checkpoint.meta["step"])
            log.info("resumed from checkpoint at step %d", step)
            return ResumePoint(checkpoint, step, int(checkpoint.meta["tokens"]))
        if refused_steps:  # keep the step count (and the schedule), not the weights
            step = max(refused_steps)
            log.warning("no checkpoint verifies; starting from the global weights at step %d", step)
            return ResumePoint(None, step, step * tokens_per_step)
        return ResumePoint(None)

    def flush(self, timeout: float) -> bool:
        """Wait until the newest checkpoint is written; False if ``timeout`` passed first."""
        return self._uploads is None or self._uploads.flush(timeout)

    def close(self) -> None:
        if self._uploads is not None:
            self._uploads.close()
