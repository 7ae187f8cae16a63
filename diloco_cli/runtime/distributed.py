"""A learner made of several processes (``torchrun``): DDP inside, rank 0 at the edges.

Under ``torchrun --nproc-per-node N`` the N processes of one learner train one model
with ``torch.distributed`` (nccl on GPUs, gloo on CPUs).  Only rank 0 talks to storage;
every step it broadcasts a small control vector (which fragments to install, whether to
stop) and then the installed tensors, so all ranks stay identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def broadcast_control(group: ProcessGroup, values: list[int], device: torch.device) -> list[int]:
    """Rank 0's control vector on every rank (a no-op for a single process)."""
    if not group.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


@torch.no_grad()
def broadcast_parameters(group: ProcessGroup, parameters: list[torch.Tensor]) -> None:
    """Rank 0's values of these parameters on every rank."""
    if group.distributed:
        for parameter in parameters:
            dist.broadcast(parameter.data, src=0)


def leave_process_group(group: ProcessGroup) -> None:
    if group.distributed and dist.is_initialized():
        dist.destroy_process_group()
