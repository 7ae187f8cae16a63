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
Norms and sums are fp32 (torch reduces with cascaded sums), weights float64.

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

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

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
    rest.  Sums are kept in fp32 tensors, norms and weights in float64.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], mean_names: Collection[str] = ()) -> None:
        self._mean_names = frozenset(mean_names)
        self._weighted_sum = {name: torch.zeros(tuple(shape)) for name, shape in shapes.items()}
        self._weighted_unit_sum = {
            name: torch.zeros(tuple(shape)) for name, shape in shapes.items() if name not in self._mean_names
        }
        self._weighted_norm_sum = dict.fromkeys(self._weighted_unit_sum, 0.0)
        self._without_rda_sums: set[str] = set()
        """RDA tensors with parts folded in: their weighted sums are incomplete."""
        self.total_weight = 0.0
        self.count = 0

    def add(self, outer_gradients: Mapping[str, torch.Tensor], weight: float) -> None:
        """Fold in one learner's outer gradients (every tensor of the fragment)."""
        if set(outer_gradients) != set(self._weighted_sum):
            raise ValueError("an outer gradient must hold exactly the fragment's tensors")
        self.count += 1
        if weight <= 0.0:
            return
        self.total_weight += weight
        for name, gradient in outer_gradients.items():
            self._weighted_sum[name].add_(gradient, alpha=weight)
            if name in self._weighted_unit_sum:
                norm = _norm(gradient)
                if norm > 0.0:
                    self._weighted_norm_sum[name] += weight * norm
                    self._weighted_unit_sum[name].add_(gradient, alpha=weight / norm)

    def partial(self) -> PartialMerge:
        """The sums so far, to be finished elsewhere (views of this accumulator's tensors)."""
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
        if self.total_weight == 0.0:
            return {name: total.zero_() for name, total in self._weighted_sum.items()}
        merged = {}
        for name, total in self._weighted_sum.items():
            unit_sum = self._weighted_unit_sum.get(name)
            if unit_sum is not None:
                # |mean direction| = |sum w unit| / sum w; RDA = mean norm * direction / |direction|
                direction_norm = _norm(unit_sum) / self.total_weight
                if direction_norm >= VANISHING_DIRECTION:
                    mean_norm = self._weighted_norm_sum[name] / self.total_weight
                    merged[name] = unit_sum.mul_(mean_norm / (direction_norm * self.total_weight))
                    continue
                if name in self._without_rda_sums:
                    merged[name] = total.zero_()
                    continue
            merged[name] = total.div_(self.total_weight)
        return merged


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
