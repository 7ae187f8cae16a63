"""The Nesterov outer optimizer against torch's SGD and hand-computed numbers."""

import numpy as np
import pytest
import torch

from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex


def test_two_steps_golden_numbers():
    """buf = mu*buf + D; Theta -= lr*(D + mu*buf), computed by hand in float64."""
    lr, mu = 0.7, 0.9
    theta = np.array([1.0, -2.0, 0.5])
    d1, d2 = np.array([0.1, 0.2, -0.3]), np.array([-0.05, 0.4, 0.0])
    buf = d1.copy()
    theta1 = theta - lr * (d1 + mu * buf)
    buf = mu * buf + d2
    theta2 = theta1 - lr * (d2 + mu * buf)
    # spelled out: step 1 = theta - 0.7*1.9*d1; step 2 uses buf = 0.9*d1 + d2
    np.testing.assert_allclose(theta1, [1.0 - 0.133, -2.0 - 0.266, 0.5 + 0.399], atol=1e-12)

    optimizer = NesterovOuterOptimizer(learning_rate=lr, momentum=mu)
    params = {"w": torch.tensor(theta, dtype=torch.float32)}
    for gradient in (d1, d2):
        params = optimizer.step(FragmentIndex(0), params, {"w": torch.tensor(gradient, dtype=torch.float32)})
        assert params["w"].dtype == torch.float32
    np.testing.assert_allclose(params["w"].numpy(), theta2, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_matches_torch_sgd_nesterov_bit_for_bit(momentum):
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=generator)
    gradients = [torch.randn(50, generator=generator) for _ in range(5)]
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=momentum, nesterov=momentum > 0, foreach=False)
    optimizer = NesterovOuterOptimizer(learning_rate=0.7, momentum=momentum)
    ours = start.clone()
    for gradient in gradients:
        reference.grad = gradient.clone()
        sgd.step()
        ours = optimizer.step(FragmentIndex(3), {"w": ours}, {"w": gradient.clone()})["w"]
        assert torch.equal(ours, reference.detach())


def test_state_round_trips_exactly_and_fragments_are_independent():
    optimizer = NesterovOuterOptimizer(learning_rate=0.5, momentum=0.9)
    params = {"a": torch.zeros(4)}
    optimizer.step(FragmentIndex(0), params, {"a": torch.ones(4)})
    optimizer.step(FragmentIndex(1), params, {"a": torch.full((4,), 2.0)})
    assert torch.equal(params["a"], torch.zeros(4))  # parameters are never modified
    restored = NesterovOuterOptimizer(learning_rate=0.5, momentum=0.9)
    restored.load_state_tensors({k: v.clone() for k, v in optimizer.state_tensors().items()})
    gradient = torch.randn(4)
    assert torch.equal(
        optimizer.step(FragmentIndex(1), params, {"a": gradient.clone()})["a"],
        restored.step(FragmentIndex(1), params, {"a": gradient.clone()})["a"],
    )
    assert set(optimizer.state_tensors()) == {"0/a", "1/a"}
    assert torch.equal(optimizer.state_tensors()["0/a"], torch.ones(4))


def test_invalid_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="learning rate"):
        NesterovOuterOptimizer(learning_rate=0, momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        NesterovOuterOptimizer(learning_rate=0.7, momentum=1.0)
