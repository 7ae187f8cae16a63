"""A run, resolved: the recipe, every learner's place and shard, every region's bucket.

Written by ``diloco up`` as ``manifest.json`` into every region's bucket (and, for local
runs, ``runs/<run>/run.json``), so any process that can read one bucket and holds the
run's secret knows the whole run.  It never holds a secret or a credential.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_cli import __version__
from diloco_cli.codec import RunSecret
from diloco_cli.config.chaos import ChaosPlan
from diloco_cli.config.errors import ConfigError, wraps_an_interrupt
from diloco_cli.config.recipe import Recipe, RetryPolicy
from diloco_cli.core.fragments import SyncerShard
from diloco_cli.core.types import LearnerId, RegionName
from diloco_cli.store.faults import StorageFaults
from diloco_cli.store.filesystem import absolute_url, open_filesystem
from diloco_cli.store.region import RegionBucket

if TYPE_CHECKING:
    from diloco_cli.store.home import SyncerHome

FROZEN = ConfigDict(frozen=True, extra="forbid")

SYNCER_PLACE = "syncer"
"""The place of a syncer that is in no region's network."""


class ManifestError(ConfigError):
    """A run's manifest cannot be read; the message names its URL."""


class LearnerSpec(BaseModel):
    model_config = FROZEN

    id: LearnerId
    region: RegionName
    host: str
    shard: int
    """This learner's place in the data: learners are given the data's slices in the
    order of this number (see :meth:`RunSpec.data_partition`)."""
    processes: int = 1
    devices: tuple[int, ...] = ()
    """The GPUs of its host that its processes use, one each (``CUDA_VISIBLE_DEVICES``);
    empty: none given (a host without GPUs, or a run on CPUs)."""
    drain: bool = False
    """Told to leave the run (``diloco scale --learners -N``): it sends what it has
    trained, sees it delivered, and stops; it no longer counts in M."""


class ScaleChange(BaseModel):
    """One ``diloco scale`` of a running run, as its record keeps it."""

    model_config = FROZEN

    time: float
    region: RegionName
    added: tuple[LearnerId, ...] = ()
    drained: tuple[LearnerId, ...] = ()
    learners_after: int
    """M after the change."""


class RegionSpec(BaseModel):
    model_config = FROZEN

    name: RegionName
    root: str
    """The URL of the run's root in this region's bucket."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    data_source: str | None = None
    """This region's own copy of the training text, if it has one."""
    data_storage_options: dict[str, Any] = Field(default_factory=dict)


class SyncerShardSpec(BaseModel):
    """One syncer process, where it runs and keeps its state: a shard of a run with
    ``sync.shards`` > 1, or a run's only syncer (:attr:`RunSpec.syncer_shards`)."""

    model_config = FROZEN

    index: int
    name: str
    """Its process name: ``syncer-<index>``, or ``syncer`` when it is the only one."""
    host: str
    home: str
    """Its own home store (``<the syncer's home>/shard-<index>`` when there are several)."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    region: RegionName | None = None
    """The region whose network it is in; None: a place of its own."""

    @property
    def place(self) -> str:
        """Where its traffic starts, in bandwidth reports."""
        return self.region or SYNCER_PLACE


class SyncerSpec(BaseModel):
    model_config = FROZEN

    host: str
    home: str
    storage_options: dict[str, Any] = Field(default_factory=dict)
    region: RegionName | None = None
    """The region whose network the syncer is in; None: a place of its own."""
    shards: tuple[SyncerShardSpec, ...] = ()
    """With ``sync.shards`` > 1, each shard in order (then ``host`` and ``home`` are the
    placement they were derived from); empty: one syncer, as ``host`` and ``home`` say."""

    @property
    def place(self) -> str:
        """Where the syncer's traffic starts, in bandwidth reports."""
        return self.region or SYNCER_PLACE


class ReducerSpec(BaseModel):
    """A region's reducer: where it runs."""

    model_config = FROZEN

    region: RegionName
    host: str

    @property
    def name(self) -> str:
        """Its process name (``reducer-<region>``)."""
        return f"reducer-{self.region}"


class RunSpec(BaseModel):
    model_config = FROZEN

    run: str
    created: float
    diloco_version: str = __version__
    recipe: Recipe
    learners: tuple[LearnerSpec, ...]
    regions: tuple[RegionSpec, ...]
    syncer: SyncerSpec
    reducers: tuple[ReducerSpec, ...] = ()
    """One per region (a region of one learner too)."""
    chaos: ChaosPlan | None = None
    """Faults to inject (``diloco up --chaos``); None in a normal run."""
    scaling: tuple[ScaleChange, ...] = ()
    """Every ``diloco scale`` of this run, oldest first."""

    @property
    def active_learners(self) -> tuple[LearnerSpec, ...]:
        """The learners that count in M: every one not told to drain."""
        return tuple(learner for learner in self.learners if not learner.drain)

    def data_partition(self, learner: LearnerId | str) -> tuple[int, int]:
        """(slice, number of slices) of the data that ``learner`` trains on: the active
        learners share the data in the order of their ``shard`` number, so a run that
        was scaled still gives every learner a slice of its own.  Before any scaling this
        is (shard, M)."""
        me = self.learner(learner)
        members = sorted(self.active_learners if not me.drain else self.learners, key=lambda spec: spec.shard)
        return [spec.id for spec in members].index(me.id), len(members)

    def learner(self, learner: LearnerId | str) -> LearnerSpec:
        for spec in self.learners:
            if spec.id == learner:
                return spec
        raise KeyError(f"learner {learner!r} is not part of run {self.run} ({', '.join(s.id for s in self.learners)})")

    def region(self, name: RegionName | str) -> RegionSpec:
        for spec in self.regions:
            if spec.name == name:
                return spec
        raise KeyError(f"region {name!r} is not part of run {self.run}")

    def bucket(
        self, region: RegionName | str, secret: RunSecret | None, retry: RetryPolicy | None = None
    ) -> RegionBucket:
        """A region's bucket, its calls retried as the recipe says (or as ``retry`` says)."""
        spec = self.region(region)
        return RegionBucket(
            spec.name, spec.root, spec.storage_options, secret, retry or self.recipe.storage, self.faults_of(spec.name)
        )

    def speed_of(self, learner: LearnerId | str) -> float:
        """The fraction of full speed ``learner`` trains at: 1.0 unless the chaos plan
        slows it down (``--chaos slow-learner``)."""
        return self.chaos.slow_learners.get(learner, 1.0) if self.chaos else 1.0

    @property
    def keeps_payloads(self) -> bool:
        """Whether consumed payloads stay in the buckets (``--chaos keep-payloads``)."""
        return self.chaos is not None and self.chaos.keep_payloads

    def faults_of(self, region: RegionName | str) -> StorageFaults | None:
        """The storage outages the chaos plan gives ``region`` (None: none)."""
        return StorageFaults.of(self.chaos, region, [r.name for r in self.regions], self.created)

    def buckets(self, secret: RunSecret | None) -> list[RegionBucket]:
        return [self.bucket(spec.name, secret) for spec in self.regions]

    @property
    def syncer_shards(self) -> tuple[SyncerShardSpec, ...]:
        """Every syncer process: the shards, or the one syncer as shard 0 of 1 (named
        ``syncer``, its home the syncer's)."""
        if self.syncer.shards:
            return self.syncer.shards
        syncer = self.syncer
        one = SyncerShardSpec(
            index=0,
            name="syncer",
            host=syncer.host,
            home=syncer.home,
            storage_options=syncer.storage_options,
            region=syncer.region,
        )
        return (one,)

    def syncer_shard(self, index: int) -> SyncerShard:
        """Which fragments syncer shard ``index`` syncs."""
        return SyncerShard(index, len(self.syncer_shards))

    def home(self, secret: RunSecret, shard: int = 0) -> SyncerHome:
        """The home store of syncer shard ``shard`` (of the syncer, when it is the only one)."""
        from diloco_cli.store.home import SyncerHome  # its records' models: only the syncer and scale read them

        place = self.syncer_shards[shard]
        return SyncerHome(place.home, place.storage_options, secret, self.recipe.storage)

    def homes(self, secret: RunSecret) -> list[SyncerHome]:
        """Every syncer shard's home, in shard order (audits read them all)."""
        return [self.home(secret, shard) for shard in range(len(self.syncer_shards))]

    def to_json(self) -> str:
        try:
            return self.model_dump_json(indent=2)
        except Exception as error:  # `up` cleans up after a Ctrl-C, also one that lands inside pydantic
            if wraps_an_interrupt(error):
                raise KeyboardInterrupt from None
            raise


def read_run_spec(url: str, storage_options: dict[str, Any] | None = None) -> RunSpec:
    """Read a manifest (``.../manifest.json`` in a bucket, or a local ``run.json``);
    ManifestError says what is wrong with which URL."""
    filesystem, path = open_filesystem(absolute_url(url), storage_options)
    try:
        with filesystem.open(path, "rb") as handle:
            document = json.load(handle)
    except FileNotFoundError:
        raise ManifestError(
            f"{url}: no such manifest; a run's is <bucket>/<run>/manifest.json (or runs/<run>/run.json here)"
        ) from None
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise ManifestError(
            f"{url}: cannot be read as a run manifest: {type(error).__name__}: {str(error)[:200]}"
        ) from None
    if isinstance(document, dict) and "spec" in document:  # a local run record wraps the spec
        document = document["spec"]
    try:
        return RunSpec.model_validate(document)
    except ValidationError as error:
        raise ManifestError(
            f"{url} is not a manifest of this diloco ({__version__}): {error.errors()[0]['msg']}"
        ) from None


def read_secret(path: str) -> RunSecret:
    """The run's secret from a file only its owner can read (a local path or a URL)."""
    import fsspec

    with fsspec.open(path, "r") as handle:
        return RunSecret.from_hex(handle.read())
