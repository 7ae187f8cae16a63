"""A learner's checkpoint: its parameters, inner AdamW state, fragment bookkeeping and
data position, in one authenticated fp32 payload (never a pickle).

The storage rank writes and reads it from full (unsharded) values: the parameters and the
AdamW state gathered from every process of the learner (:mod:`diloco_cli.runtime.distributed`),
so a checkpoint is the same whether the learner ran in one process, under DDP or FSDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from diloco_cli.codec import CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.runtime.learner_fragments import LearnerFragments

CHECKPOINT_SPEC = CodecSpec(codec="fp32", zstd_level=1)
ADAM_BUFFERS = ("exp_avg", "exp_avg_sq")

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


def generator_state(generator: torch.Generator) -> str:
    """A data generator's position as text (stored in checkpoint metadata)."""
    return bytes(generator.get_state().tolist()).hex()


def restore_generator(generator: torch.Generator, state: str) -> None:
    generator.set_state(torch.tensor(list(bytes.fromhex(state)), dtype=torch.uint8))
