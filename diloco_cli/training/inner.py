"""The inner optimization: AdamW with linear warmup and cosine decay, one step at a time.

Each learner runs these steps on its own shard without waiting for anyone (DiLoCo's
inner loop, arXiv 2311.08105, Algorithm 1); the inner optimizer's state is never
exchanged and survives the installation of new global weights.

A step is the same computation however the learner runs: in one process or several
(DDP or FSDP2, see :mod:`diloco_cli.runtime.distributed`), in fp32 or under bf16
autocast, on a whole batch or accumulated over micro-batches.  Nothing here names a
device: tensors stay where the model and the batch are.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

LossFunction = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss(model, inputs, targets) -> scalar``: the mean loss of a batch (``training.loss``)."""


@dataclass(frozen=True)
class InnerSchedule:
    """Learning rate over inner steps: linear warmup, then cosine decay to a floor."""

    peak_learning_rate: float
    warmup_steps: int
    total_steps: int
    final_fraction: float = 0.1

    def learning_rate(self, step: int) -> float:
        """The learning rate for inner step ``step`` (counted from 0)."""
        if step < self.warmup_steps:
            return self.peak_learning_rate * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.peak_learning_rate * (self.final_fraction + (1 - self.final_fraction) * cosine)


def make_inner_optimizer(
    model: torch.nn.Module, learning_rate: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or embeddings' 1-D).

    Under FSDP2 build it after the model is sharded, so that it holds the sharded
    parameters (and its state is sharded like them)."""
    decayed = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def language_model_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) of the logits the model returns, or
    of their ``.logits`` (Hugging Face causal LMs return an output object).

    The cross-entropy is taken in fp32 even when the logits are bf16 (autocast): the
    log-sum-exp over a large vocabulary loses too much in bf16."""
    output = model(inputs)
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def resolve_loss(import_path: str | None) -> LossFunction:
    """The loss named by ``training.loss`` (``module:callable``); None is :func:`language_model_loss`."""
    if import_path is None:
        return language_model_loss
    module_name, separator, attribute = import_path.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(f"training.loss must look like 'package.module:callable', got {import_path!r}")
    try:
        loss = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"training.loss {import_path!r} cannot be imported: {error}") from None
    if not callable(loss):
        raise ValueError(f"training.loss {import_path!r} is not callable")
    return loss


def autocast_for(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context for forward and loss at ``precision`` (``training.precision``).

    ``bf16`` is autocast only: parameters, gradients and AdamW's state stay fp32 (the
    master weights), so the deltas a learner sends are fp32 whatever the precision."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"training.precision must be 'fp32' or 'bf16', got {precision!r}")


@contextlib.contextmanager
def _gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Let the backward passes inside reduce gradients across processes, or only
    accumulate them locally: with micro-batches only the last one needs to communicate.

    FSDP2 modules are recognised by their ``set_requires_gradient_sync`` rather than by
    class, so that a process that never shards (the syncer) need not import FSDP (half a second)."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _micro_batches(
    inputs: torch.Tensor, targets: torch.Tensor, micro_batch_size: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch cut into equal micro-batches along its first dimension (the whole batch
    for None or a size not below the batch)."""
    batch_size = inputs.shape[0]
    if micro_batch_size is None or micro_batch_size >= batch_size:
        return [(inputs, targets)]
    if batch_size % micro_batch_size:
        raise ValueError(
            f"training.micro_batch_size {micro_batch_size} does not divide this process's batch of {batch_size} "
            "sequences (training.batch_size / processes_per_learner): choose a divisor"
        )
    return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))


def accumulate_gradients(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    micro_batch_size: int | None = None,
    precision: str = "fp32",
    loss_fn: LossFunction = language_model_loss,
) -> torch.Tensor:
    """The gradient of one batch's mean loss, in the parameters' ``.grad`` (set afresh);
    returns the batch's mean loss (of this process's part) as a detached scalar tensor.

    ``model`` is what the loop calls: the model itself, DDP around it or the model
    sharded by FSDP2.  With ``micro_batch_size`` the gradients of equal micro-batches
    accumulate, each micro-batch's mean loss scaled by its share of the batch, so the
    sum is the gradient of the whole batch's mean loss; only the last backward reduces
    across processes.  The first half of :func:`inner_step`: a caller that averages
    gradients itself (the benchmarks' data-parallel trainer) does so before
    :func:`apply_gradients`."""
    model.zero_grad(set_to_none=True)
    parts = _micro_batches(inputs, targets, micro_batch_size)
    total = torch.zeros((), device=inputs.device)
    for index, (part_inputs, part_targets) in enumerate(parts):
        with _gradient_sync(model, enabled=index == len(parts) - 1):
            with autocast_for(inputs.device, precision):
                loss = loss_fn(model, part_inputs, part_targets) * (part_inputs.shape[0] / inputs.shape[0])
            loss.backward()
        total += loss.detach()
    return total


def apply_gradients(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, learning_rate: float, gradient_clip: float | None
) -> None:
    """The AdamW step at ``learning_rate`` on the gradients in ``.grad``, clipped first to a
    total norm of ``gradient_clip`` (none when 0 or None).  Clipping sees the full gradient
    norm under FSDP2 too (``clip_grad_norm_`` reduces the sharded norms).  The second half
    of :func:`inner_step`."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    if gradient_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip)
    optimizer.step()


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    learning_rate: float,
    gradient_clip: float | None = 1.0,
    *,
    micro_batch_size: int | None = None,
    precision: str = "fp32",
    loss_fn: LossFunction = language_model_loss,
) -> float:
    """One AdamW step on one batch, as a learner takes it; returns the batch's mean loss
    (of this process's part): :func:`accumulate_gradients` then :func:`apply_gradients`."""
    total = accumulate_gradients(
        model, inputs, targets, micro_batch_size=micro_batch_size, precision=precision, loss_fn=loss_fn
    )
    apply_gradients(model, optimizer, learning_rate, gradient_clip)
    return float(total)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFunction = language_model_loss,
    precision: str = "fp32",
) -> float:
    """Mean loss over fixed held-out batches, moved to the model's device.

    Under FSDP2 every process must call it (each forward gathers the parameters)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = []
    for inputs, targets in batches:
        with autocast_for(device, precision):
            losses.append(float(loss_fn(model, inputs.to(device), targets.to(device))))
    model.train(was_training)
    return sum(losses) / len(losses)
