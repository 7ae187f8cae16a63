"""The inner optimization: AdamW with linear warmup and cosine decay, one step at a time.

Each learner runs these steps on its own shard without waiting for anyone (DiLoCo's
inner loop, arXiv 2311.08105, Algorithm 1); the inner optimizer's state is never
exchanged and survives the installation of new global weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional as F


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


def make_inner_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or embeddings' 1-D)."""
    decayed = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def language_model_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per byte)."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def inner_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    learning_rate: float,
    gradient_clip: float | None = 1.0,
) -> float:
    """One AdamW step on one batch; returns the batch loss."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    loss = language_model_loss(model, inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if gradient_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over fixed held-out batches."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = [float(language_model_loss(model, x.to(device), y.to(device))) for x, y in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
