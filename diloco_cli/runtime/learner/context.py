"""What a learner's duties share, built once from the run spec.

A training loop hands its sync side a :class:`TrainedModel` (the model, its inner
optimizer, the processes that train it); :func:`learner_context` adds who the learner
is in the run and, on the storage rank, its region's bucket and its fragments'
bookkeeping.  The duties (sends, installs, heartbeats, checkpoints) take the
:class:`LearnerContext` rather than the same six arguments each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from diloco_cli.codec import RunSecret
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.fragments import Fragment, SendPacing, fragments_of_model
from diloco_cli.runtime.distributed import ProcessGroup
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.store.region import RegionBucket
from diloco_cli.store.run_spec import LearnerSpec, RunSpec


class DataPosition(Protocol):
    """Where a training loop is in its data, saved with each checkpoint."""

    def state(self) -> str:
        """The position as text."""

    def restore(self, state: str | None, step: int) -> None:
        """Go back to a saved position; with ``None`` (no checkpoint, or not rank 0), to
        a position computed from the step alone."""


@dataclass(frozen=True)
class TrainedModel:
    """What a training loop gives the learner's sync side."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    """The inner optimizer (AdamW), checkpointed with the model."""
    group: ProcessGroup
    """The learner's processes (one, or every rank under ``torchrun``)."""
    tokens_per_step: int
    """The tokens one inner step trains, over every process of the learner."""
    data_position: DataPosition | None = None
    """Where the loop is in its data, saved with each checkpoint (None: not saved)."""


@dataclass(frozen=True)
class LearnerContext:
    """One learner's identity, settings and storage, as its duties share them."""

    me: LearnerSpec
    recipe: Recipe
    secret: RunSecret
    group: ProcessGroup
    fragment_list: tuple[Fragment, ...]
    """The model's fragments, as every learner and the syncer cut it."""
    bucket: RegionBucket | None = None
    """The learner's region's bucket: on the storage rank only (the others touch no storage)."""
    fragments: LearnerFragments | None = None
    """The fragments' bookkeeping (bases, residuals, counters): on the storage rank only."""

    @cached_property
    def pacing(self) -> SendPacing:
        """When each fragment is due (``sync.pace``): every process keeps its own copy."""
        sync = self.recipe.sync
        return SendPacing(
            sync.num_fragments, self.recipe.paces_by_merges, sync.sync_interval_schedule, sync.sync_interval
        )

    @property
    def parameter_names(self) -> list[str]:
        """Every parameter's name, fragment by fragment."""
        return [name for fragment in self.fragment_list for name in fragment.parameter_names]


def learner_context(spec: RunSpec, learner: str, secret: RunSecret, trained: TrainedModel) -> LearnerContext:
    """The context of ``learner`` of the run ``spec`` describes, training ``trained``."""
    recipe, me, group = spec.recipe, spec.learner(learner), trained.group
    fragment_list = fragments_of_model(trained.model, recipe.sync.num_fragments)
    if not group.is_storage_rank:
        return LearnerContext(me, recipe, secret, group, fragment_list)
    shapes = {name: parameter.shape for name, parameter in trained.model.named_parameters()}
    fragments = LearnerFragments(fragment_list, shapes, keep_unsent=recipe.keeps_unsent_work)
    return LearnerContext(me, recipe, secret, group, fragment_list, spec.bucket(me.region, secret), fragments)
