"""The inner step: gradient accumulation, bf16 autocast, models that return ``.logits``
and losses of one's own."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch
from torch.nn import functional as F

from diloco_cli.config.recipe import ModelConfig
from diloco_cli.training.inner import (
    accumulate_gradients,
    apply_gradients,
    evaluate,
    inner_step,
    language_model_loss,
    make_inner_optimizer,
    resolve_loss,
)

MODEL = ModelConfig(kwargs={"num_layers": 2, "width": 32, "num_heads": 2, "context": 16})


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = MODEL.build()
    return model, make_inner_optimizer(model, 3e-3, 0.1, (0.9, 0.95))


def token_batch(batch: int = 16, length: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 256, (batch, length + 1), generator=torch.Generator().manual_seed(seed))
    return rows[:, :-1], rows[:, 1:]


@dataclass
class CausalLMOutput:
    """What a Hugging Face causal LM returns: an object holding the logits."""

    logits: torch.Tensor


class ReturnsOutputObject(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(logits=self.inner(tokens))


def test_micro_batches_step_like_the_whole_batch():
    whole, whole_optimizer = model_and_optimizer()
    micro, micro_optimizer = model_and_optimizer()
    for seed in range(3):
        inputs, targets = token_batch(seed=seed)
        whole_loss = inner_step(whole, whole_optimizer, inputs, targets, 3e-3, 1.0)
        micro_loss = inner_step(micro, micro_optimizer, inputs, targets, 3e-3, 1.0, micro_batch_size=4)
        assert micro_loss == pytest.approx(whole_loss, abs=1e-6)  # the whole batch's mean loss
    for (name, left), right in zip(whole.named_parameters(), micro.parameters()):
        # the same sums in another order; AdamW turns rounding near zero into ~1e-5
        assert torch.allclose(left, right, atol=3e-5), name


def test_the_halves_with_gradients_averaged_between_them_step_like_the_whole_batch():
    """bench/ddp_worker.py's step: each rank accumulates its part's gradients, the ranks
    average them, and each applies the AdamW step: the inner step on the whole batch."""
    whole, whole_optimizer = model_and_optimizer()
    ranks = [model_and_optimizer() for _ in range(2)]
    for seed in range(3):
        inputs, targets = token_batch(seed=seed)
        whole_loss = inner_step(whole, whole_optimizer, inputs, targets, 3e-3, 1.0)
        parts = zip(inputs.chunk(2), targets.chunk(2))
        losses = [accumulate_gradients(model, *part) for (model, _), part in zip(ranks, parts)]
        for left, right in zip(ranks[0][0].parameters(), ranks[1][0].parameters()):
            left.grad = right.grad = (left.grad + right.grad) / 2
        for model, optimizer in ranks:
            apply_gradients(model, optimizer, 3e-3, 1.0)
        assert float(sum(losses)) / 2 == pytest.approx(whole_loss, abs=1e-6)
    for (name, left), first, second in zip(
        whole.named_parameters(), ranks[0][0].parameters(), ranks[1][0].parameters()
    ):
        assert torch.equal(first, second), name  # the same averaged gradient: the same weights
        assert torch.allclose(left, first, atol=3e-5), name  # the same sums in another order


def test_the_micro_batch_size_must_divide_the_batch():
    model, optimizer = model_and_optimizer()
    with pytest.raises(ValueError, match="micro_batch_size 5 does not divide this process's batch of 16"):
        inner_step(model, optimizer, *token_batch(), 3e-3, micro_batch_size=5)


def test_bf16_autocast_keeps_fp32_weights_gradients_and_optimizer_state():
    fp32, fp32_optimizer = model_and_optimizer()
    bf16, bf16_optimizer = model_and_optimizer()
    inputs, targets = token_batch()
    fp32_loss = inner_step(fp32, fp32_optimizer, inputs, targets, 3e-3)
    bf16_loss = inner_step(bf16, bf16_optimizer, inputs, targets, 3e-3, precision="bf16", micro_batch_size=8)
    assert bf16_loss == pytest.approx(fp32_loss, abs=0.05)
    for parameter in bf16.parameters():
        assert parameter.dtype == parameter.grad.dtype == torch.float32
        assert bf16_optimizer.state[parameter]["exp_avg"].dtype == torch.float32
    assert evaluate(bf16, [token_batch()], precision="bf16") == pytest.approx(evaluate(bf16, [token_batch()]), abs=0.05)
    with pytest.raises(ValueError, match="training.precision must be 'fp32' or 'bf16', got 'fp16'"):
        inner_step(bf16, bf16_optimizer, inputs, targets, 3e-3, precision="fp16")


def test_models_that_return_an_object_with_logits_train_like_the_plain_model():
    plain, plain_optimizer = model_and_optimizer()
    inner, wrapped_optimizer = model_and_optimizer()
    wrapped = ReturnsOutputObject(inner)
    inputs, targets = token_batch()
    with torch.no_grad():
        assert float(language_model_loss(wrapped, inputs, targets)) == float(
            language_model_loss(plain, inputs, targets)
        )
    assert inner_step(wrapped, wrapped_optimizer, inputs, targets, 3e-3) == inner_step(
        plain, plain_optimizer, inputs, targets, 3e-3
    )
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), inner.parameters()))
    assert evaluate(wrapped, [token_batch(seed=2)]) == evaluate(plain, [token_batch(seed=2)])


def mean_logit_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs).mean()


def test_a_loss_of_ones_own_is_imported_and_used(monkeypatch):
    module = types.ModuleType("my_losses")
    module.mean_logit_loss = mean_logit_loss
    module.not_a_function = 3
    monkeypatch.setitem(sys.modules, "my_losses", module)
    assert resolve_loss(None) is language_model_loss
    loss = resolve_loss("my_losses:mean_logit_loss")
    assert loss is mean_logit_loss
    model, optimizer = model_and_optimizer()
    inputs, targets = token_batch()
    expected = float(model(inputs).detach().mean())
    assert inner_step(model, optimizer, inputs, targets, 3e-3, loss_fn=loss, micro_batch_size=4) == pytest.approx(
        expected, abs=1e-6
    )
    assert evaluate(model, [(inputs, targets)], loss_fn=loss) == pytest.approx(
        float(model(inputs).detach().mean()), abs=1e-6
    )

    with pytest.raises(ValueError, match=r"training.loss 'my_losses:missing' cannot be imported"):
        resolve_loss("my_losses:missing")
    with pytest.raises(
        ValueError, match=r"training.loss 'no_such_module_here:loss' cannot be imported: No module named"
    ):
        resolve_loss("no_such_module_here:loss")
    with pytest.raises(ValueError, match=r"training.loss must look like 'package.module:callable', got 'my_losses'"):
        resolve_loss("my_losses")
    with pytest.raises(ValueError, match=r"training.loss 'my_losses:not_a_function' is not callable"):
        resolve_loss("my_losses:not_a_function")


def test_the_cross_entropy_is_taken_in_fp32_from_bf16_logits():
    class Bf16Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("logits", torch.randn(2, 3, 1000).to(torch.bfloat16))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.logits

    model = Bf16Logits()
    targets = torch.randint(0, 1000, (2, 3))
    loss = language_model_loss(model, torch.zeros(2, 3, dtype=torch.long), targets)
    assert loss.dtype == torch.float32
    assert float(loss) == float(F.cross_entropy(model.logits.float().reshape(-1, 1000), targets.reshape(-1)))
