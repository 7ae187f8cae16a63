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

from collections.abc import Mapping, Sequence

import torch

from diloco_cli.core.types import FragmentIndex


def nesterov_step_(
    gradient: torch.Tensor,
    buffer: torch.Tensor,
    parameters: torch.Tensor,
    learning_rate: float,
    momentum: float,
    *,
    first: bool,
) -> torch.Tensor:
    """One Nesterov outer step of one tensor, or of any slice of it (every operation is
    elementwise, so slices computed apart give the bits of the whole): ``buffer``
    becomes ``mu * buffer + D`` (``D`` itself on the first step, like SGD's), and
    ``gradient`` comes back holding ``Theta_new = Theta - lr * (D + mu * buffer)``."""
    if first:
        buffer.copy_(gradient)
    else:
        buffer.mul_(momentum).add_(gradient)
    if momentum:
        gradient.add_(buffer, alpha=momentum)
    return torch.add(parameters, gradient, alpha=-learning_rate, out=gradient)


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
        buffers, first = self.momentum_buffers(fragment, {name: g.shape for name, g in outer_gradient.items()})
        return {
            name: self.step_slice(gradient, buffers[name], parameters[name], first=name in first)
            for name, gradient in outer_gradient.items()
        }

    def momentum_buffers(
        self, fragment: FragmentIndex, shapes: Mapping[str, Sequence[int]]
    ) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """The fragment's momentum buffer of each tensor, for :meth:`step_slice`, and the
        names whose buffer is new (their first step writes it): what a caller stepping
        a fragment slice by slice needs."""
        buffers = self._buffers.setdefault(fragment, {})
        first = frozenset(name for name in shapes if name not in buffers)
        for name in first:
            buffers[name] = torch.empty(tuple(shapes[name]))
        return {name: buffers[name] for name in shapes}, first

    def step_slice(
        self, gradient: torch.Tensor, buffer: torch.Tensor, parameters: torch.Tensor, *, first: bool
    ) -> torch.Tensor:
        """:func:`nesterov_step_` with this optimizer's learning rate and momentum."""
        return nesterov_step_(gradient, buffer, parameters, self.learning_rate, self.momentum, first=first)

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
