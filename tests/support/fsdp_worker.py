"""One rank of a learner of several processes, for tests/integration/test_fsdp.py.

Started as ``python -m tests.support.fsdp_worker --out DIR [--compile] PARALLELISM...`` by the test with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).  For
each parallelism (``fsdp``, ``ddp``) in one process group, every rank:

1. builds the small default model from the same seed and prepares it
   (:func:`prepare_model`, compiled with ``--compile``), then takes :data:`STEPS` AdamW steps on its part of the
   same batches (its half, in micro-batches of :data:`MICRO_BATCH`, clipped);
2. gathers the parameters and the optimizer state (rank 0 keeps them);
3. loads that state into a fresh optimizer and gathers it again;
4. installs :func:`installed_values` and records its own local tensors (its shards
   under FSDP2, whole tensors under DDP) and the gathered result;
5. takes one more step from the installed values with the reloaded optimizer.

Rank r writes ``record_name(PARALLELISM, COMPILE, R)``; the test compares it with one process that
trains on the whole batches (:func:`train` here, shared by both sides).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from diloco_cli.config.recipe import ModelConfig
from diloco_cli.runtime.distributed import (
    ProcessGroup,
    choose_device,
    full_optimizer_state,
    full_parameters,
    install_parameters,
    join_process_group,
    leave_process_group,
    load_full_optimizer_state,
    prepare_model,
)
from diloco_cli.training.inner import evaluate, inner_step, make_inner_optimizer

MODEL = ModelConfig(kwargs={"num_layers": 2, "width": 64, "num_heads": 4, "context": 32})
SEQUENCE_LENGTH = 32
BATCH = 16
MICRO_BATCH = 4
STEPS = 5
LEARNING_RATE = 1e-2
GRADIENT_CLIP = 0.3
"""Below the gradient norm of every one of these steps (0.4 to 0.8), so that the clip always acts."""


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MODEL.build()


def make_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return make_inner_optimizer(model, LEARNING_RATE, 0.1, (0.9, 0.95))


def batches() -> list[torch.Tensor]:
    """STEPS training batches and one for the step after the install, as token rows."""
    generator = torch.Generator().manual_seed(1)
    return list(torch.randint(0, 256, (STEPS + 1, BATCH, SEQUENCE_LENGTH + 1), generator=generator))


def installed_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 tensors shaped like the parameters: what rank 0 installs."""
    generator = torch.Generator().manual_seed(2)
    return {
        name: torch.randn(parameter.shape, generator=generator) * 0.02 for name, parameter in model.named_parameters()
    }


def train(
    prepared: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: torch.Tensor, micro_batch_size: int | None
) -> float:
    """One inner step on token rows (inputs and next-token targets); returns its loss."""
    return inner_step(
        prepared, optimizer, rows[:, :-1], rows[:, 1:], LEARNING_RATE, GRADIENT_CLIP, micro_batch_size=micro_batch_size
    )


def local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What this rank holds of each parameter: its shard under FSDP2, else the whole tensor."""
    return {
        name: (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach().clone()
        for name, parameter in model.named_parameters()
    }


def record_name(parallelism: str, compile: bool, rank: int) -> str:
    return f"{parallelism}{'-compiled' if compile else ''}-rank{rank}.pt"


# What the tests compare: one process (no group), and records of parameters and optimizer state.

ONE_PROCESS = ProcessGroup()


def max_difference(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> float:
    assert left.keys() == right.keys()
    return max(float((left[name] - right[name]).abs().max()) for name in left)


def bitwise_equal(left: dict, right: dict) -> bool:
    return left.keys() == right.keys() and all(
        bitwise_equal(left[key], right[key]) if isinstance(left[key], dict) else torch.equal(left[key], right[key])
        for key in left
    )


def run(parallelism: str, compile: bool, device: torch.device, group: ProcessGroup, out: Path) -> None:
    model = build_model()
    prepared = prepare_model(model, device, group, parallelism, compile)
    optimizer = make_optimizer(model)
    part = BATCH // group.world_size
    rows = [batch[group.rank * part : (group.rank + 1) * part] for batch in batches()]
    losses = [train(prepared, optimizer, batch, MICRO_BATCH) for batch in rows[:STEPS]]
    # A forward without a backward leaves FSDP2's root unsharded: gathers and installs must still see the shards.
    evaluate(prepared, [(rows[0][:, :-1], rows[0][:, 1:])])

    names = [name for name, _ in model.named_parameters()]
    trained = full_parameters(model, names, group)
    state = full_optimizer_state(model, optimizer, group)
    reloaded = make_optimizer(model)
    load_full_optimizer_state(model, reloaded, state if group.is_storage_rank else None, group)
    state_again = full_optimizer_state(model, reloaded, group)

    install_parameters(model, installed_values(model) if group.is_storage_rank else None, names, group)
    local = local_tensors(model)
    installed = full_parameters(model, names, group)
    train(prepared, reloaded, rows[STEPS], MICRO_BATCH)
    stepped = full_parameters(model, names, group)

    record = {
        "losses": losses,
        "local": local,
        "trained": trained,
        "state": state,
        "state_again": state_again,
        "installed": installed,
        "stepped": stepped,
    }
    torch.save(record, out / record_name(parallelism, compile, group.rank))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compile", action="store_true", help="torch.compile the prepared model")
    parser.add_argument("parallelisms", nargs="+", choices=["fsdp", "ddp"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = choose_device("cpu", int(os.environ["LOCAL_RANK"]))
    group = join_process_group(device)
    clean = False
    try:
        for parallelism in args.parallelisms:
            run(parallelism, args.compile, device, group, args.out)
        clean = True
    finally:
        leave_process_group(group, clean)


if __name__ == "__main__":
    main()
