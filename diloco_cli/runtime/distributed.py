"""A learner made of several processes (``torchrun``): DDP or FSDP2 inside, rank 0 at the edges.

Under ``torchrun --nproc-per-node N`` the N processes of one learner train one model
with ``torch.distributed`` (nccl on GPUs, gloo on CPUs), either each holding the whole
model (DDP) or each holding a shard of every parameter, gradient and AdamW buffer (FSDP2,
``training.parallelism: fsdp``).  Only rank 0 talks to storage, and it deals in full CPU
fp32 tensors only: it gathers the full parameters it sends and checkpoints
(:func:`full_parameters`, :func:`full_optimizer_state`), and every rank takes its part
of what rank 0 installs (:func:`install_parameters`, :func:`load_full_optimizer_state`).
So payloads and checkpoints are the same whatever the learner's layout.

Every function here that takes a ``group`` is a collective when the learner has several
processes: every rank calls it at the same point with the same names in the same order.
Devices always come from the model's parameters, never from a default.  A learner of one
process never imports FSDP2 and DTensor (half a second at every start).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("diloco.learner")

ADAM_BUFFERS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-parameter buffers, shaped like the parameter (sharded like it under FSDP2)."""


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in its learner."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_storage_rank(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def choose_device(preference: str, local_rank: int) -> torch.device:
    """``auto``: this process's GPU when CUDA is available, else the CPU."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("training.device is 'cuda' but torch sees no CUDA device on this host")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def join_process_group(device: torch.device) -> ProcessGroup:
    """Join torchrun's process group when started by torchrun (nccl on GPU, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return ProcessGroup()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return ProcessGroup(rank=dist.get_rank(), world_size=world_size, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def broadcast_ints(group: ProcessGroup, values: list[int], device: torch.device) -> list[int]:
    """Rank 0's integers on every rank (a no-op for a single process); the learner's
    typed records travel this way (:mod:`diloco_cli.runtime.learner.control`)."""
    if not group.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


LEAVING_BARRIER_SECONDS = 60.0
"""How long a rank that finished waits for the others before it leaves the group anyway."""


def leave_process_group(group: ProcessGroup, clean: bool = True) -> None:
    """Leave torchrun's process group.  After a clean run every rank meets at a barrier
    first, so that none closes its gloo connections while a peer still uses them (a
    peer's closed socket aborts gloo's thread: "terminate called without an active
    exception"); after an error there is no barrier, since a dead peer would hold it."""
    if group.distributed and dist.is_initialized():
        if clean and dist.get_backend() == "gloo":
            try:  # a peer that never comes is named, and does not hold this rank for long
                dist.monitored_barrier(timeout=timedelta(seconds=LEAVING_BARRIER_SECONDS))
            except RuntimeError as error:
                log.warning("leaving the process group without every rank: %s", error)
        elif clean:
            dist.barrier()
        dist.destroy_process_group()


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model: the members of its outermost ``ModuleList``\\ s
    (``model.blocks`` of the built-in GPT, ``model.model.layers`` of a Hugging Face
    causal LM), found without knowing the architecture."""
    blocks: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList):
                blocks.extend(child)
            else:
                visit(child)

    visit(model)
    return blocks


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no
    values) and their buffers for real: each parameter is moved to the meta device as it
    is registered, before the module's own initialisation fills it, while buffers (a
    rotary embedding's frequencies, a causal mask) keep the values their module computed."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None) -> None:
        if parameter is not None and parameter.device.type != "meta":
            parameter = type(parameter)(parameter.to("meta"), requires_grad=parameter.requires_grad)
        register(module, name, parameter)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_model(
    build: Callable[[], torch.nn.Module],
    device: torch.device,
    group: ProcessGroup,
    parallelism: str,
    compile: bool,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The learner's model (its parameters keep the recipe's names) and the module the
    training loop calls (:func:`prepare_model`).

    Under FSDP2 (several processes, ``parallelism`` ``fsdp``) the model is never whole,
    on any rank or GPU: it is built with its parameters on the meta device
    (:func:`parameters_on_meta`), sharded, and only then does each rank allocate its own
    shards, on ``device``.  Their values are undefined until installed: the learner
    installs every parameter (the global weights, or its checkpoint) shard by shard from
    rank 0 before its first step, which is also why the initial values never need to
    agree across ranks.  Buffers are the module's own, as built.  Otherwise the model is
    built whole and moved to ``device``."""
    if not (group.distributed and parallelism == "fsdp"):
        model = build()
        return model, prepare_model(model, device, group, parallelism, compile)
    with parameters_on_meta():
        model = build()
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    prepared = prepare_model(model, device, group, parallelism, compile)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    return model, prepared


def prepare_model(
    model: torch.nn.Module, device: torch.device, group: ProcessGroup, parallelism: str, compile: bool
) -> torch.nn.Module:
    """The module the training loop calls (``inner_step``'s ``model``).

    One process: the model itself.  ``ddp``: DDP around it.  ``fsdp``: the model sharded
    in place by FSDP2 (``fully_shard`` on each transformer block, then on the root, which
    keeps the embeddings, the head and everything outside the blocks), so the returned
    module *is* ``model`` and keeps its parameter names.  Build the inner optimizer from
    ``model`` after this call: under FSDP2 its parameters are now sharded DTensors.

    With ``compile`` the module is compiled in place (its type and names unchanged, so
    ``inner_step`` still recognises DDP and FSDP2): the whole module without FSDP2, each
    block before it is sharded with FSDP2 (the way torchtitan does it, so the
    communication between blocks stays outside the compiled graphs).  FSDP2 moves each
    shard to the device itself, leaving parameters on the meta device there
    (:func:`build_model`).
    """
    if not (group.distributed and parallelism == "fsdp"):
        model.to(device)
    if not group.distributed:
        prepared = model
    elif parallelism == "ddp":
        prepared = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    elif parallelism == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (group.world_size,))
        for block in transformer_blocks(model):
            if compile:
                block.compile()
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    else:
        raise ValueError(f"training.parallelism must be 'ddp' or 'fsdp', got {parallelism!r}")
    if compile:
        prepared.compile()
    return prepared


def _sharded_parameters(model: torch.nn.Module, group: ProcessGroup) -> dict[str, torch.nn.Parameter]:
    """The model's parameters as the optimizer holds them.  A forward without a backward
    (an evaluation) leaves FSDP2's root module unsharded, with full plain tensors
    registered in place of its sharded ones; resharding (a no-op when sharded) puts the
    shards back, so that gathers and installs reach the values FSDP2 trains."""
    if group.distributed:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    return dict(model.named_parameters())


def _is_shard(tensor: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether this is a DTensor (a parameter or AdamW buffer of FSDP2), which only a
    learner of several processes can hold."""
    if not group.distributed:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _full_on_storage_rank(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor | None:
    """A CPU fp32 copy of the whole tensor on rank 0, None elsewhere (every rank takes
    part in gathering a sharded one)."""
    full = tensor.full_tensor() if _is_shard(tensor, group) else tensor
    if not group.is_storage_rank:
        return None
    return full.detach().to(device="cpu", dtype=torch.float32, copy=True)


def _from_storage_rank(full: torch.Tensor | None, like: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Rank 0's ``full`` as this rank holds a tensor laid out like ``like``: its shard,
    cut exactly as FSDP2 cuts ``like`` (:func:`_scattered_shard`), or a whole copy
    (broadcast); on ``like``'s device and in its dtype."""
    if _is_shard(like, group):
        return _scattered_shard(full, like, group)
    if group.is_storage_rank:
        source = full.to(device=like.device, dtype=like.dtype, copy=True)
    else:
        source = torch.empty(like.shape, device=like.device, dtype=like.dtype)
    if group.distributed:
        dist.broadcast(source, src=0)
    return source


def _scattered_shard(full: torch.Tensor | None, like: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Rank 0's ``full`` cut as FSDP2 cuts ``like`` (a DTensor sharded on dim 0 over the
    learner's processes: ``torch.chunk``'s rows, the last shards shorter or empty) and
    scattered, so that every rank but 0 holds only its own shard, never the whole tensor."""
    from torch.distributed.tensor import DTensor, Shard

    assert tuple(like.placements) == (Shard(0),), f"FSDP2 shards dim 0 over one mesh dimension, not {like.placements}"
    rows = -(-like.shape[0] // group.world_size)
    padded_shape = (rows, *like.shape[1:])
    received = torch.empty(padded_shape, device=like.device, dtype=like.dtype)
    pieces = None
    if group.is_storage_rank:
        source = full.to(device=like.device, dtype=like.dtype)
        pieces = [torch.zeros(padded_shape, device=like.device, dtype=like.dtype) for _ in range(group.world_size)]
        for piece, chunk in zip(pieces, source.split(rows)):
            piece[: len(chunk)].copy_(chunk)
    dist.scatter(received, pieces, src=0)
    local = received[: like.to_local().shape[0]]
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def full_parameters(model: torch.nn.Module, names: Iterable[str], group: ProcessGroup) -> dict[str, torch.Tensor]:
    """Every named parameter's full value as a CPU fp32 tensor on rank 0; the other ranks
    get ``{}`` but must call it too (under FSDP2 each parameter is all-gathered).

    ``model`` is the module given to :func:`prepare_model` (its names are the recipe's:
    DDP's wrapper would prefix them)."""
    parameters = _sharded_parameters(model, group)
    gathered = {name: _full_on_storage_rank(parameters[name], group) for name in names}
    return {name: value for name, value in gathered.items() if value is not None}


@torch.no_grad()
def install_parameters(
    model: torch.nn.Module, values: Mapping[str, torch.Tensor] | None, names: Iterable[str], group: ProcessGroup
) -> None:
    """Rank 0's ``values`` (full tensors, e.g. CPU fp32) become these parameters on every
    rank, bit for bit: each rank copies in its own shard (FSDP2) or the whole tensor.
    Only rank 0 passes ``values``; the copy is in place, so the optimizer keeps its
    parameters and its state (the inner state survives an install, as in DiLoCo)."""
    parameters = _sharded_parameters(model, group)
    for name in names:
        parameter = parameters[name]
        parameter.copy_(_from_storage_rank(values[name] if group.is_storage_rank else None, parameter, group))


def full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: ProcessGroup
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state for checkpoints, per parameter name: ``step`` (a CPU scalar tensor)
    and ``exp_avg``, ``exp_avg_sq`` as full CPU fp32 tensors, on rank 0 (``{}`` elsewhere).

    Parameters without state yet (no step taken) are left out."""
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, parameter in _sharded_parameters(model, group).items():
        entry = optimizer.state.get(parameter)
        if not entry:
            continue  # the same on every rank: all take the same steps
        buffers = {buffer: _full_on_storage_rank(entry[buffer], group) for buffer in ADAM_BUFFERS}
        if group.is_storage_rank:
            state[name] = {"step": torch.as_tensor(entry["step"]).detach().to("cpu", copy=True), **buffers}
    return state


@torch.no_grad()
def load_full_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Mapping[str, Any]] | None,
    group: ProcessGroup,
) -> None:
    """The inverse of :func:`full_optimizer_state`: rank 0's ``state`` (``step`` a number
    or a scalar tensor, the buffers full tensors) becomes every rank's AdamW state, each
    rank holding its shard of the buffers.  Parameters that ``state`` leaves out lose
    their state (AdamW starts them afresh).  Only rank 0 passes ``state``."""
    named = list(_sharded_parameters(model, group).items())
    device = named[0][1].device
    # Which parameters have state, and their step counts: only rank 0 knows them.
    steps = (
        [int(state[name]["step"]) if name in state else -1 for name, _ in named]
        if group.is_storage_rank
        else [0] * len(named)
    )
    steps = broadcast_ints(group, steps, device)
    settings = {parameter: options for options in optimizer.param_groups for parameter in options["params"]}
    for (name, parameter), step in zip(named, steps):
        if step < 0:
            optimizer.state.pop(parameter, None)
            continue
        options = settings[parameter]
        # AdamW keeps its step on the CPU unless it runs fused or capturable.
        step_device = parameter.device if options.get("fused") or options.get("capturable") else torch.device("cpu")
        entry = {"step": torch.tensor(float(step), dtype=torch.float32, device=step_device)}
        for buffer in ADAM_BUFFERS:
            entry[buffer] = _from_storage_rank(state[name][buffer] if group.is_storage_rank else None, parameter, group)
        optimizer.state[parameter] = entry
