"""What every collaborator of one syncer (shard) shares, fixed for its life.

Built once from the run spec (:func:`syncer_context`) and handed to the syncer's
collaborators (:mod:`.build`), rather than the same five arguments to each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diloco_cli.codec import RunSecret
from diloco_cli.config.recipe import Recipe
from diloco_cli.core.fragments import SyncerShard
from diloco_cli.runtime.syncer.fanout import FanOut
from diloco_cli.store.home import SyncerHome
from diloco_cli.store.region import RegionBucket
from diloco_cli.store.run_spec import RunSpec, SyncerShardSpec


@dataclass(frozen=True)
class SyncerContext:
    """One syncer's recipe, identity, stores and clock."""

    recipe: Recipe
    """The run's recipe (a ``diloco scale`` changes the learners, never the recipe's sync settings)."""
    shard: SyncerShard
    """Which fragments this syncer syncs (every one, with a single syncer)."""
    place: SyncerShardSpec
    """Where this syncer (shard) runs and keeps its home."""
    secret: RunSecret
    buckets: dict[str, RegionBucket]
    """Every region's bucket, by region name, as this shard sees it (its ``global/`` prefix)."""
    home: SyncerHome
    """The syncer's own store: its commits, ledger and published updates."""
    fanout: FanOut
    """Calls to every region at once (one thread per region)."""
    clock: Callable[[], float]
    """The syncer's clock (monotonic seconds); injected so that tests can drive it."""


def syncer_context(spec: RunSpec, secret: RunSecret, shard_index: int, clock: Callable[[], float]) -> SyncerContext:
    """The context of syncer shard ``shard_index`` of the run ``spec`` describes."""
    shard = spec.syncer_shard(shard_index)
    buckets = {bucket.name: bucket.for_syncer_shard(shard) for bucket in spec.buckets(secret)}
    return SyncerContext(
        recipe=spec.recipe,
        shard=shard,
        place=spec.syncer_shards[shard_index],
        secret=secret,
        buckets=buckets,
        home=spec.home(secret, shard_index),
        fanout=FanOut(len(buckets)),
        clock=clock,
    )
