"""The outer optimizer: Nesterov momentum on merged outer gradients, per fragment.

DiLoCo (arXiv 2311.08105, Algorithm 1) treats the averaged difference between the global
parameters and the learners' as a gradient and applies SGD with Nesterov momentum::

    buf = mu * buf + D
    Theta_new = Theta - lr * (D + mu * buf)

exactly ``torch.optim.SGD(nesterov=True, dampening=0)`` fed ``grad = D``, with the same
operations in the same order.  Each fragment keeps its own momentum buffer because
fragments are merged at different times (Streaming DiLoCo, arXiv 2501.18512).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco_cli.core.types import FragmentIndex


class NesterovOuterOptimizer:
    """Nesterov outer steps with momentum buffers per fragment and tensor."""

    def __init__(self, learning_rate: float, momentum: float) -> None:
        if learning_rate <= 0:
            raise ValueError(f"the outer learning rate must be positive, got {learning_rate}")
        if not 0 <= momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {momentum}")
        self.learning_rate = learning_rate
        self.momentum = momentum
        self._buffers: dict[FragmentIndex, dict[str, torch.Tensor]] = {}

    def step(
        self,
        fragment: FragmentIndex,
        parameters: Mapping[str, torch.Tensor],
        outer_gradient: Mapping[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """Advance the momentum and return ``Theta_new`` per tensor.

        ``parameters`` are not modified: the syncer publishes ``U = Theta_new - Theta``
        (quantized) and applies what it published.  The outer gradient's tensors are
        used as workspace (they come back holding ``Theta_new``), which saves a
        fragment-sized allocation per tensor; pass copies to keep them.
        """
        buffers = self._buffers.setdefault(fragment, {})
        new_parameters = {}
        for name, gradient in outer_gradient.items():
            buffer = buffers.get(name)
            if buffer is None:
                buffer = buffers[name] = gradient.detach().clone()
            else:
                buffer.mul_(self.momentum).add_(gradient)
            if self.momentum:
                gradient.add_(buffer, alpha=self.momentum)
            new_parameters[name] = torch.add(parameters[name], gradient, alpha=-self.learning_rate, out=gradient)
        return new_parameters

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The momentum buffers keyed ``"<fragment>/<tensor name>"`` (for safetensors)."""
        return {
            f"{fragment}/{name}": buffer
            for fragment, buffers in sorted(self._buffers.items())
            for name, buffer in buffers.items()
        }

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore buffers written by :meth:`state_tensors` (exactly, bit for bit)."""
        self._buffers = {}
        for key, buffer in tensors.items():
            fragment, _, name = key.partition("/")
            self._buffers.setdefault(FragmentIndex(int(fragment)), {})[name] = buffer.clone()
