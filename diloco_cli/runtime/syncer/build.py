"""A syncer's collaborators, built in one place from the run spec.

:func:`build_syncer` restores the syncer's state from its home and wires the few
collaborators of its loop around it: what it observes of the regions
(:class:`~.observation.Observer`), what it publishes (:class:`~.publication.Publication`),
how it merges (:class:`~.merging.Merger`), what it evaluates
(:class:`~.evaluation.Evaluator`), reports (:class:`~.status.StatusBoard`) and sweeps
(:class:`~.leftovers.LeftoverSweeper`), how it follows the manifest
(:class:`~.following.ManifestFollower`) and when it ends (:class:`~.ending.RunEnd`).
:func:`initial_decisions` continues the committed decision state.  Nothing here reads a
region: that is the loop's first turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from diloco_cli.codec.exact import ExactPublisher
from diloco_cli.core import decisions
from diloco_cli.core.fragments import Fragment, SyncerShard, fragments_of_model
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.runtime.global_weights import GlobalCopy, encode_snapshot
from diloco_cli.runtime.membership import ControlNotes, ManifestWatch
from diloco_cli.runtime.syncer.context import SyncerContext
from diloco_cli.runtime.syncer.ending import RunEnd
from diloco_cli.runtime.syncer.evaluation import Evaluator
from diloco_cli.runtime.syncer.following import ManifestFollower
from diloco_cli.runtime.syncer.leftovers import LeftoverSweeper
from diloco_cli.runtime.syncer.merging import Merger
from diloco_cli.runtime.syncer.observation import Observer
from diloco_cli.runtime.syncer.publication import Publication
from diloco_cli.runtime.syncer.state import SyncerState, restore_state
from diloco_cli.runtime.syncer.status import StatusBoard
from diloco_cli.store.documents import Head
from diloco_cli.store.retry import RetryPolicy
from diloco_cli.store.run_spec import RunSpec

HOME = "home"
"""The syncer's home among its sweepers (the others are keyed by region)."""


@dataclass(frozen=True)
class SyncerParts:
    """The collaborators of one syncer's loop, around its restored state."""

    fragments: tuple[Fragment, ...]
    """Every fragment of the model (a shard syncs those ``context.shard`` owns)."""
    state: SyncerState
    evaluator: Evaluator
    observer: Observer
    notes: ControlNotes
    publication: Publication
    merger: Merger
    board: StatusBoard
    sweepers: dict[str, LeftoverSweeper]
    """The leftovers sweepers: every region's (shard 0 only) and the home's (:data:`HOME`)."""
    follower: ManifestFollower
    run_end: RunEnd


def build_syncer(
    spec: RunSpec, context: SyncerContext, head: Callable[[], Head], manifest: ManifestWatch | None = None
) -> SyncerParts:
    """Restore the state of the syncer ``context`` names from its home store (the model
    built from the recipe's seed is version 0) and build its collaborators; ``head``
    gives the head of its weights as they are now (the loop knows whether it finished);
    ``manifest``, the run's manifest it follows (``diloco scale``, ``diloco chaos``)."""
    recipe, sync, shard = context.recipe, context.recipe.sync, context.shard
    torch.manual_seed(recipe.training.seed)
    model = recipe.model.build()
    fragments = fragments_of_model(model, sync.num_fragments, sync.merge)
    initial = {name: p.detach() for name, p in model.named_parameters()}
    evaluator = _evaluator(spec, context, model, fragments)
    state = restore_state(
        context.home,
        context.secret,
        fragments,
        initial,
        NesterovOuterOptimizer(recipe.outer_learning_rate, sync.outer_momentum),
        ExactPublisher(sync.update_codec, context.secret),
        sync.window_versions,
        lambda theta, version: evaluator.evaluate(theta, version, tokens=0, whole=True) if evaluator.enabled else None,
        owned=shard.of(fragments),
    )
    probes = {
        name: spec.bucket(name, context.secret, retry=RetryPolicy(attempts=1)).for_syncer_shard(shard)
        for name in context.buckets
    }
    observer = Observer(context, probes, state.ledger.consumed)
    publication = Publication(context, head, lambda: _snapshot(context, fragments, state))
    sweepers = {  # the regions' buckets are shard 0's to sweep
        name: LeftoverSweeper(bucket.store, sync.leftover_seconds)
        for name, bucket in context.buckets.items()
        if shard.index == 0
    }
    sweepers[HOME] = LeftoverSweeper(context.home.store, sync.leftover_seconds, only_partial=True)
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    notes = ControlNotes(context.buckets, observer.refused)
    return SyncerParts(
        fragments=fragments,
        state=state,
        evaluator=evaluator,
        observer=observer,
        notes=notes,
        publication=publication,
        merger=Merger(context, fragments, state),
        board=StatusBoard(context, state, observer, publication, sweepers, parameters),
        sweepers=sweepers,
        follower=ManifestFollower(manifest, context, observer, notes),
        run_end=RunEnd(observer, evaluator, sync.give_up_seconds),
    )


def initial_decisions(spec: RunSpec, state: SyncerState, num_fragments: int, now: float) -> decisions.DecisionState:
    """A fresh decision state that continues the committed one (versions, windows,
    what each learner had merged, the moving averages)."""
    sync = spec.recipe.sync
    policy = decisions.DecisionPolicy(
        num_learners=len(spec.active_learners),
        quorum=spec.recipe.quorum,
        num_fragments=num_fragments,
        grace_gamma=sync.grace_gamma,
        overlap_steps=sync.overlap_steps,
        max_grace_seconds=sync.max_grace_seconds,
        liveness_timeout_seconds=sync.liveness_timeout_seconds,
        give_up_seconds=sync.give_up_seconds,
    )
    versions = {p: (version, state.windows[p].oldest_anchorable) for p, version in state.fragment_versions.items()}
    fresh = decisions.initial_state(policy, now, versions)
    return replace(
        fresh,
        merged_sequence=dict(state.ledger.merged),
        quorum_seconds=state.quorum_seconds,
        sync_seconds=state.sync_seconds,
    )


def _evaluator(spec: RunSpec, context: SyncerContext, model: torch.nn.Module, fragments) -> Evaluator:
    """Shard 0 (or the only syncer) evaluates the whole model: with other shards, their
    fragments as read from its region's bucket (the first region's, when it is in none)."""
    shard = context.shard
    if shard.index != 0:
        return Evaluator(context.recipe, model, enabled=False)
    if not shard.sharded:
        return Evaluator(context.recipe, model)
    region = context.place.region or spec.regions[0].name
    others = [SyncerShard(index, shard.count) for index in range(1, shard.count)]
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}  # version 0, from the seed
    copy = GlobalCopy(context.buckets[region], context.secret, fragments, others, initial)
    return Evaluator(context.recipe, model, copy)


def _snapshot(context: SyncerContext, fragments: tuple[Fragment, ...], state: SyncerState) -> bytes:
    """A snapshot of the fragments this syncer syncs (every one, with one syncer)."""
    shard = context.shard
    owned = {name for fragment in shard.of(fragments) for name in fragment.parameter_names}
    theta = {name: tensor for name, tensor in state.theta.items() if name in owned or not shard.sharded}
    return encode_snapshot(theta, context.secret, state.version, state.fragment_versions)
