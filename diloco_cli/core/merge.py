"""Merging the learners' outer gradients: token weights, weighted mean and RDA.

Decoupled DiLoCo (arXiv 2604.21428) weights each learner's outer gradient by
``w_m = c_tokens^2 / c_steps`` (tokens processed times tokens per step) and merges every
non-embedding tensor with radial-directional averaging::

    RDA = (sum w_m |D_m| / sum w_m) * unit(sum w_m unit(D_m) / sum w_m)

so the merged norm is the weighted mean of the norms whatever the number of learners
merged (a plain mean of near-orthogonal vectors shrinks like 1/sqrt(M)).  Embedding
tensors use the weighted mean ``sum w_m D_m / sum w_m``, and so does RDA when the mean
direction vanishes.

Arrivals stream through :class:`MergeAccumulator` one at a time, so a merge holds two
running sums per tensor and never all M outer gradients: its memory does not grow with M.
Sums are fp32, weights float64, norms float64 (summed in fp32 by torch for tensors in
memory, in float64 by the codec's kernels).  The accumulator reads each arrival through
:class:`OuterGradients`: a mapping of tensors (torch ops, :class:`TensorOuterGradients`)
or a payload decoded, anchored and folded in by the codec's fused kernels in one pass
(:class:`~diloco_cli.codec.fold.AnchoredPayload`).  Its sums may be buffers that a caller
reuses from round to round: they are written, not added to, by their first arrival, so
they need no zeroing.

The sums are additive, so a merge can be computed in parts: a region's reducer folds in
its learners and hands on its :class:`PartialMerge` (the weighted sum of unit vectors and
the weighted sum of norms of each RDA tensor, the weighted sum of each mean tensor, the
total weight); the syncer adds the parts of every region (:meth:`MergeAccumulator.add_partial`)
and finishes the same RDA.  A part carries no weighted sum of its RDA tensors (that
would double what crosses the WAN), so a merge made of parts falls back to zero, not to
the weighted mean, where the mean direction vanishes (every outer gradient zero, or
exactly opposite ones).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

VANISHING_DIRECTION = 1e-6
"""RDA falls back to the weighted mean when |mean of unit vectors| is below this."""


def token_weight(c_tokens: int, c_steps: int) -> float:
    """A learner's merge weight ``c_tokens^2 / c_steps``; 0 when either count is 0."""
    if c_tokens <= 0 or c_steps <= 0:
        return 0.0
    return float(c_tokens) * float(c_tokens) / float(c_steps)


def _norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor))


class OuterGradients(Protocol):
    """One learner's outer gradients ``D``, tensor by tensor, as a merge reads them."""

    names: Collection[str]

    def norm(self, name: str) -> float:
        """``|D|`` of tensor ``name``."""
        ...

    def fold(
        self,
        name: str,
        weighted_sum: torch.Tensor | None,
        weight: float,
        unit_sum: torch.Tensor | None = None,
        unit_weight: float = 0.0,
        *,
        overwrite_weighted: bool = False,
        overwrite_unit: bool = False,
    ) -> None:
        """``weighted_sum += weight * D`` and ``unit_sum += unit_weight * D`` (each sum
        written instead where its overwrite flag is set; None skips it)."""
        ...


class TensorOuterGradients:
    """:class:`OuterGradients` of tensors in memory, with torch ops."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.names = tensors.keys()

    def norm(self, name: str) -> float:
        return _norm(self.tensors[name])

    def fold(
        self,
        name: str,
        weighted_sum: torch.Tensor | None,
        weight: float,
        unit_sum: torch.Tensor | None = None,
        unit_weight: float = 0.0,
        *,
        overwrite_weighted: bool = False,
        overwrite_unit: bool = False,
    ) -> None:
        gradient = self.tensors[name]
        for total, factor, overwrite in (
            (weighted_sum, weight, overwrite_weighted),
            (unit_sum, unit_weight, overwrite_unit),
        ):
            if total is None:
                continue
            if overwrite:
                torch.mul(gradient, factor, out=total)
            else:
                total.add_(gradient, alpha=factor)


class Workspace(Protocol):
    """Where a merge's sums live and how it takes their norms."""

    def tensors(self, role: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Uninitialised fp32 tensors of ``shapes`` for the sums called ``role``
        (``"weighted_sum"``, ``"unit_sum"``)."""
        ...

    def norm(self, tensor: torch.Tensor) -> float:
        """The L2 norm of a tensor of the merge."""
        ...


class FreshWorkspace:
    """The default :class:`Workspace`: new tensors every merge, torch's norm."""

    def tensors(self, role: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        return {name: torch.empty(shape) for name, shape in shapes.items()}

    def norm(self, tensor: torch.Tensor) -> float:
        return _norm(tensor)


@dataclass
class PartialMerge:
    """The running sums of a merge over some of its arrivals (a region's, at its reducer)."""

    total_weight: float
    count: int
    unit_sums: dict[str, torch.Tensor]
    """Per RDA tensor: ``sum w_m unit(D_m)``."""
    norm_sums: dict[str, float]
    """Per RDA tensor: ``sum w_m |D_m|``."""
    mean_sums: dict[str, torch.Tensor]
    """Per mean tensor (the embedding): ``sum w_m D_m``."""


class MergeAccumulator:
    """Running sums for merging the outer gradients of one fragment.

    ``add`` folds in one learner's outer gradients with its weight; ``result`` returns
    the merged outer gradient per tensor: weighted mean for ``mean_names``, RDA for the
    rest.  Sums are kept in fp32 tensors, norms and weights in float64.  ``workspace``
    gives the sums' tensors (uninitialised: each is written by its first arrival, or
    zeroed when read before any) and takes the norms of the merged directions.
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]],
        mean_names: Collection[str] = (),
        workspace: Workspace | None = None,
    ) -> None:
        self._mean_names = frozenset(mean_names)
        self._workspace = workspace or FreshWorkspace()
        shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self._weighted_sum = self._workspace.tensors("weighted_sum", shapes)
        self._weighted_unit_sum = self._workspace.tensors(
            "unit_sum", {name: shape for name, shape in shapes.items() if name not in self._mean_names}
        )
        self._unwritten = {id(total) for total in (*self._weighted_sum.values(), *self._weighted_unit_sum.values())}
        """The sums no arrival wrote yet: the first write overwrites them."""
        self._weighted_norm_sum = dict.fromkeys(self._weighted_unit_sum, 0.0)
        self._without_rda_sums: set[str] = set()
        """RDA tensors with parts folded in: their weighted sums are incomplete."""
        self.total_weight = 0.0
        self.count = 0

    def add(self, outer_gradients: OuterGradients | Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold in one learner's outer gradients (every tensor of the fragment)."""
        if isinstance(outer_gradients, Mapping):
            outer_gradients = TensorOuterGradients(outer_gradients)
        if set(outer_gradients.names) != set(self._weighted_sum):
            raise ValueError("an outer gradient must hold exactly the fragment's tensors")
        self.count += 1
        if weight <= 0.0:
            return
        self.total_weight += weight
        for name in outer_gradients.names:
            total, unit_sum, unit_weight = self._weighted_sum[name], self._weighted_unit_sum.get(name), 0.0
            if unit_sum is not None:
                norm = outer_gradients.norm(name)
                if norm > 0.0:
                    self._weighted_norm_sum[name] += weight * norm
                    unit_weight = weight / norm
                else:
                    unit_sum = None
            outer_gradients.fold(
                name,
                total,
                weight,
                unit_sum,
                unit_weight,
                overwrite_weighted=self._first_write(total),
                overwrite_unit=unit_sum is not None and self._first_write(unit_sum),
            )

    def _first_write(self, total: torch.Tensor) -> bool:
        if id(total) in self._unwritten:
            self._unwritten.discard(id(total))
            return True
        return False

    def _zero_unwritten(self) -> None:
        for total in (*self._weighted_sum.values(), *self._weighted_unit_sum.values()):
            if self._first_write(total):
                total.zero_()

    def partial(self) -> PartialMerge:
        """The sums so far, to be finished elsewhere (views of this accumulator's tensors)."""
        self._zero_unwritten()
        return PartialMerge(
            total_weight=self.total_weight,
            count=self.count,
            unit_sums=dict(self._weighted_unit_sum),
            norm_sums=dict(self._weighted_norm_sum),
            mean_sums={name: self._weighted_sum[name] for name in self._mean_names},
        )

    def add_partial(self, part: PartialMerge) -> None:
        """Fold in the sums another accumulator made over other arrivals.  Its RDA tensors'
        weighted sums are not known: where the merged direction vanishes, they give zero."""
        if set(part.unit_sums) | set(part.mean_sums) != set(self._weighted_sum):
            raise ValueError("a partial merge must hold exactly the fragment's tensors")
        self._zero_unwritten()
        self.count += part.count
        if part.total_weight <= 0.0:
            return
        self.total_weight += part.total_weight
        for name, unit_sum in part.unit_sums.items():
            self._weighted_unit_sum[name].add_(unit_sum)
            self._weighted_norm_sum[name] += part.norm_sums[name]
            self._without_rda_sums.add(name)
        for name, total in part.mean_sums.items():
            self._weighted_sum[name].add_(total)

    def result(self) -> dict[str, torch.Tensor]:
        """The merged outer gradient; zeros when no arrival had a positive weight.

        Computed in place in the running sums, so call it once, after the last ``add``.
        """
        return {name: finish(total) for name, (total, finish) in self.finishing().items()}

    def finishing(self) -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
        """How :meth:`result` computes each merged tensor, for a caller that goes on with
        it slice by slice while the slice is in cache: the running sum it is computed in,
        and the in-place elementwise operation that turns any slice of that sum into
        the merged values (the norms it needs are taken here).  Call it once."""
        self._zero_unwritten()
        if self.total_weight == 0.0:
            return {name: (total, torch.Tensor.zero_) for name, total in self._weighted_sum.items()}
        finishing = {}
        total_weight = self.total_weight
        for name, total in self._weighted_sum.items():
            unit_sum = self._weighted_unit_sum.get(name)
            if unit_sum is not None:
                # |mean direction| = |sum w unit| / sum w; RDA = mean norm * direction / |direction|
                direction_norm = self._workspace.norm(unit_sum) / total_weight
                if direction_norm >= VANISHING_DIRECTION:
                    mean_norm = self._weighted_norm_sum[name] / total_weight
                    factor = mean_norm / (direction_norm * total_weight)
                    finishing[name] = (unit_sum, lambda values, factor=factor: values.mul_(factor))
                    continue
                if name in self._without_rda_sums:
                    finishing[name] = (total, torch.Tensor.zero_)
                    continue
            finishing[name] = (total, lambda values: values.div_(total_weight))
        return finishing


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum w_m x_m / sum w_m`` of one tensor per learner (zeros if all weights are 0)."""
    return _merge_one(tensors, weights, mean=True)


def radial_directional_average(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Weighted RDA of one tensor per learner (see the module docstring)."""
    return _merge_one(tensors, weights, mean=False)


def _merge_one(tensors: Sequence[torch.Tensor], weights: Sequence[float], *, mean: bool) -> torch.Tensor:
    if len(tensors) != len(weights) or not tensors:
        raise ValueError("give one weight per tensor, and at least one tensor")
    accumulator = MergeAccumulator({"x": tensors[0].shape}, mean_names={"x"} if mean else ())
    for tensor, weight in zip(tensors, weights):
        accumulator.add({"x": tensor.to(torch.float32)}, weight)
    return accumulator.result()["x"]
