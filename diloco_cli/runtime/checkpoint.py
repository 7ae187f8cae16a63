"""A learner's checkpoint: its parameters, inner AdamW state, fragment bookkeeping and
data position, in one authenticated fp32 payload (never a pickle)."""

from __future__ import annotations

from typing import Any

import torch

from diloco_cli.codec import CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.runtime.learner_fragments import LearnerFragments

CHECKPOINT_SPEC = CodecSpec(codec="fp32", zstd_level=1)
ADAM_BUFFERS = ("exp_avg", "exp_avg_sq")


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own index order."""
    name_of = {id(parameter): name for name, parameter in model.named_parameters()}
    return [name_of[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]


def encode_checkpoint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    fragments: LearnerFragments,
    secret: RunSecret,
    meta: dict[str, Any],
) -> bytes:
    names = _parameter_names(model, optimizer)
    state = optimizer.state_dict()["state"]
    tensors: dict[str, torch.Tensor] = {f"model/{n}": p.detach() for n, p in model.named_parameters()}
    adam_steps = {}
    for index, name in enumerate(names):
        if index in state:
            adam_steps[name] = float(state[index]["step"])
            for buffer in ADAM_BUFFERS:
                tensors[f"adam/{name}/{buffer}"] = state[index][buffer]
    tensors.update(fragments.state_tensors())
    full_meta = {**meta, "adam_steps": adam_steps, "fragments": fragments.state_meta()}
    return encode_payload(tensors.items(), CHECKPOINT_SPEC, secret, full_meta)


@torch.no_grad()
def restore_checkpoint(
    payload: bytes,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    fragments: LearnerFragments,
    secret: RunSecret,
) -> dict[str, Any]:
    """Load a checkpoint into the model, optimizer and fragments; returns its metadata."""
    decoded = decode_payload(payload, secret)
    tensors, meta = decoded.tensors, decoded.meta
    for name, parameter in model.named_parameters():
        parameter.copy_(tensors[f"model/{name}"])
    names = _parameter_names(model, optimizer)
    device_of = {name: parameter.device for name, parameter in model.named_parameters()}
    state_dict = optimizer.state_dict()
    state_dict["state"] = {
        index: {
            "step": torch.tensor(meta["adam_steps"][name]),
            **{buffer: tensors[f"adam/{name}/{buffer}"].to(device_of[name]) for buffer in ADAM_BUFFERS},
        }
        for index, name in enumerate(names)
        if name in meta["adam_steps"]
    }
    optimizer.load_state_dict(state_dict)
    fragments.load_state(tensors, meta["fragments"])
    return meta


def generator_state(generator: torch.Generator) -> str:
    """A data generator's position as text (stored in checkpoint metadata)."""
    return bytes(generator.get_state().tolist()).hex()


def restore_generator(generator: torch.Generator, state: str) -> None:
    generator.set_state(torch.tensor(list(bytes.fromhex(state)), dtype=torch.uint8))
