"""A run's objects in one region's bucket: the layout and the operations on it.

Layout under the run's root (see docs/protocol.md)::

    manifest.json                                   the run: recipe, learners, regions
    payloads/<learner>/<fragment>-<sequence>.dlc    a learner's delta      (+ .ready)
    control/<learner>.epoch                         how often the learner started (sealed)
    heartbeats/<learner>.json                       a learner's heartbeat  (sealed)
    checkpoints/<learner>/<step>.dlc                a learner's checkpoint (+ .ready)
    control/<learner>.json                          the syncer's notes to a learner (sealed)
    global/updates/<version>-<fragment>.dlc         a published update     (+ .ready)
    global/snapshots/<version>.dlc                  full global weights    (+ .ready)
    global/head.json                                newest version, recent updates (sealed)
    global/syncer.json                              the syncer's status    (sealed)
    aggregates/, reducer/                           the region's reducer (store.aggregates)

With syncer shards (``sync.shards`` > 1) each shard's global objects and control notes
lie under ``global/shard-<s>/`` instead (:class:`SyncerLayout`); a bucket seen through
one shard's layout (:meth:`RegionBucket.for_syncer_shard`) reads and writes that shard's.

Immutable objects (``.dlc``) are written first and their marker last, and read only when
marked; markers are authenticated metadata frames.  Mutable objects are small typed
documents (:mod:`diloco_cli.store.documents`) written whole and sealed with the run's key.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from diloco_cli.codec import CodecSpec, PayloadError, RunSecret, declared_values, encode_payload, read_header
from diloco_cli.core.fragments import SyncerShard
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.documents import ChaosLog, ControlNote, EpochRecord, Head, Heartbeat, SyncerStatus
from diloco_cli.store.faults import StorageFaults
from diloco_cli.store.objects import ObjectStore
from diloco_cli.store.retry import RetryPolicy

MARKER_SPEC = CodecSpec(zstd_level=0)
SNAPSHOT_SPEC = CodecSpec(codec="fp32", zstd_level=1)
"""Snapshots are the global weights exactly: fp32, lightly compressed."""
SEQUENCE_PER_EPOCH = 1_000_000
"""A learner numbers its sends ``epoch * SEQUENCE_PER_EPOCH + n``, its epoch counting its
starts, so that a restarted learner's sequence numbers never repeat an earlier start's."""
PAYLOAD_KEY = re.compile(r"^payloads/(?P<learner>[^/]+)/(?P<fragment>\d{3})-(?P<sequence>\d{12})\.dlc$")
RELAY_KEY = re.compile(r"^relays/(?P<learner>[^/]+)/(?P<fragment>\d{3})-(?P<sequence>\d{12})\.dlc$")
"""A learner's payload as its region's reducer relays it to the syncer unanchored (the
payload and its marker, copied): under K < M, where the syncer anchors each send itself."""
CHECKPOINT_KEY = re.compile(r"^checkpoints/(?P<learner>[^/]+)/(?P<step>\d{10})\.dlc$")
CHAOS_KEY = "chaos.json"
SHARD_ROOT = re.compile(r"^global/shard-\d+/")
"""The start of a key that syncer shard s (of several) writes."""


@dataclass(frozen=True)
class SyncerLayout:
    """Where one syncer's objects lie in a region's bucket: those of a run's only syncer
    under ``global/`` (its notes to learners under ``control/``), and, in a run of
    several syncer shards, all of shard s's under ``global/shard-<s>/``: its head, its
    status, its updates and snapshots, its control notes.  The region's reducer for that
    shard keeps its status and epoch under the shard's name too."""

    shard: int | None = None
    """The syncer shard, or None for a run's only syncer."""

    @property
    def root(self) -> str:
        return "global/" if self.shard is None else f"global/shard-{self.shard}/"

    @property
    def head_key(self) -> str:
        return f"{self.root}head.json"

    @property
    def status_key(self) -> str:
        return f"{self.root}syncer.json"

    @property
    def updates(self) -> str:
        return f"{self.root}updates"

    @property
    def snapshots(self) -> str:
        return f"{self.root}snapshots"

    def update_key(self, version: Version, fragment: FragmentIndex) -> str:
        return f"{self.updates}/{version:010d}-{fragment:03d}.dlc"

    def snapshot_key(self, version: Version) -> str:
        return f"{self.snapshots}/{version:010d}.dlc"

    @cached_property
    def update_pattern(self) -> re.Pattern[str]:
        return re.compile(rf"^{re.escape(self.updates)}/(?P<version>\d{{10}})-(?P<fragment>\d{{3}})\.dlc$")

    @cached_property
    def snapshot_pattern(self) -> re.Pattern[str]:
        return re.compile(rf"^{re.escape(self.snapshots)}/(?P<version>\d{{10}})\.dlc$")

    def control_key(self, learner: LearnerId) -> str:
        """The syncer's note to ``learner``."""
        return f"control/{learner}.json" if self.shard is None else f"{self.root}control/{learner}.json"

    @property
    def reducer_status_key(self) -> str:
        """The status of the region's reducer (for this shard's fragments)."""
        return "reducer/status.json" if self.shard is None else f"reducer/shard-{self.shard}/status.json"

    @property
    def reducer_name(self) -> LearnerId:
        """The name the region's reducer counts its starts under (``control/<name>.epoch``)."""
        return LearnerId("reducer" if self.shard is None else f"reducer.shard-{self.shard}")


ONE_SYNCER = SyncerLayout()
"""The layout of a run with one syncer."""
HEAD_KEY = ONE_SYNCER.head_key
SYNCER_STATUS_KEY = ONE_SYNCER.status_key
UPDATE_KEY = ONE_SYNCER.update_pattern
SNAPSHOT_KEY = ONE_SYNCER.snapshot_pattern
update_key = ONE_SYNCER.update_key
snapshot_key = ONE_SYNCER.snapshot_key
control_key = ONE_SYNCER.control_key
ANY_UPDATE_KEY = re.compile(r"^global/(?:shard-\d+/)?updates/(?P<version>\d{10})-(?P<fragment>\d{3})\.dlc$")
"""An update of any syncer (shard)."""
ANY_SNAPSHOT_KEY = re.compile(r"^global/(?:shard-\d+/)?snapshots/(?P<version>\d{10})\.dlc$")
"""A snapshot of any syncer (shard)."""
AGGREGATE_KEY = re.compile(r"^aggregates/(?P<fragment>\d{3})-(?P<serial>\d{12})\.dlc$")
"""A region's reducer's aggregate (:mod:`diloco_cli.store.aggregates`)."""
RESIDUAL_KEY = re.compile(r"^reducer/residuals/(?P<fragment>\d{3})-(?P<serial>\d{12})\.dlc$")
"""A region's reducer's error feedback after one of its aggregates."""
MARKED_KEYS = (PAYLOAD_KEY, RELAY_KEY, CHECKPOINT_KEY, ANY_UPDATE_KEY, ANY_SNAPSHOT_KEY, AGGREGATE_KEY, RESIDUAL_KEY)
"""Every kind of object written with a marker (``put_marked``): a reader uses one only
once its marker is there, and the leftover sweeper keeps both while both are there and
removes either without the other.  A new marked kind is added here."""


KIND_BY_PREFIX = (
    ("payloads/", "payload"),
    ("aggregates/", "aggregate"),
    ("relays/", "aggregate"),
    ("reducer/", "reducer"),
    ("global/updates/", "update"),
    ("global/snapshots/", "snapshot"),
    ("global/control/", "control"),
    ("checkpoints/", "checkpoint"),
    (HEAD_KEY, "head"),
    (SYNCER_STATUS_KEY, "status"),
    ("heartbeats/", "heartbeat"),
    ("control/", "control"),
    ("manifest.json", "manifest"),
)


def kind_of_key(key: str) -> str:
    """The kind of object a key names, for metering (:mod:`diloco_cli.store.metering`);
    a syncer shard's objects are of the kind of the same object of a run's only syncer."""
    if key.endswith(".ready"):
        return "marker"
    key = SHARD_ROOT.sub("global/", key)
    return next((kind for prefix, kind in KIND_BY_PREFIX if key.startswith(prefix)), "other")


def payload_key(learner: LearnerId, fragment: FragmentIndex, sequence: int) -> str:
    return f"payloads/{learner}/{fragment:03d}-{sequence:012d}.dlc"


def relay_key(payload: str) -> str:
    """Where a reducer relays the payload at ``payload`` (the same learner, fragment and sequence)."""
    return "relays/" + payload.removeprefix("payloads/")


def relayed_payload_key(relay: str) -> str:
    """The payload a relay at ``relay`` copies."""
    return "payloads/" + relay.removeprefix("relays/")


def checkpoint_key(learner: LearnerId, step: int) -> str:
    return f"checkpoints/{learner}/{step:010d}.dlc"


def heartbeat_key(learner: LearnerId) -> str:
    return f"heartbeats/{learner}.json"


def epoch_key(learner: LearnerId) -> str:
    return f"control/{learner}.epoch"


@dataclass(frozen=True)
class PayloadRecord:
    """A learner's marked payload, as its authenticated marker describes it."""

    key: str
    learner: LearnerId
    fragment: FragmentIndex
    sequence: int
    base_version: Version
    c_steps: int
    c_tokens: int
    meta: dict[str, Any]


class RegionBucket:
    """The run's objects in one region's bucket."""

    def __init__(
        self,
        name: str,
        root: str,
        storage_options: dict[str, Any] | None,
        secret: RunSecret | None,
        retry: RetryPolicy | None = None,
        faults: StorageFaults | None = None,
    ) -> None:
        self.name = name
        self.store = ObjectStore(root, storage_options, retry, kind_of_key, faults)
        self._secret = secret
        self.layout = ONE_SYNCER
        """Whose global objects and control notes this bucket reads and writes."""

    def __repr__(self) -> str:
        return f"RegionBucket({self.name!r}, {self.store.root!r})"

    def for_syncer_shard(self, shard: SyncerShard) -> RegionBucket:
        """The same bucket (the same store, so its calls are counted together) seen
        through syncer shard ``shard``'s layout: its head, updates, snapshots, status and
        control notes; with one syncer, the layout of today."""
        view = copy.copy(self)
        view.layout = SyncerLayout(shard.index) if shard.sharded else ONE_SYNCER
        return view

    def syncer_shards(self, count: int) -> list[RegionBucket]:
        """The bucket as each of ``count`` syncer shards lays it out, in shard order."""
        return [self.for_syncer_shard(SyncerShard(index, count)) for index in range(count)]

    @property
    def secret(self) -> RunSecret:
        if self._secret is None:
            raise RuntimeError("this operation needs the run's secret")
        return self._secret

    @property
    def optional_secret(self) -> RunSecret | None:
        """The secret if this bucket holds it (documents are then verified), else None."""
        return self._secret

    def marker(self, meta: dict[str, Any]) -> bytes:
        """An authenticated marker carrying ``meta`` (written after the object it marks)."""
        return encode_payload([], MARKER_SPEC, self.secret, meta)

    def marker_meta(self, key: str) -> dict[str, Any]:
        """The verified metadata of ``key``'s marker (PayloadError when not authentic)."""
        return read_header(self.store.get_marker(key), self.secret).meta

    # ---------------------------------------------------------------- run manifest

    def write_manifest(self, manifest_json: str) -> None:
        self.store.put("manifest.json", manifest_json.encode())

    def delete_manifest(self) -> None:
        """Take the manifest back (a run interrupted before it started)."""
        self.store.delete("manifest.json")

    # -------------------------------------------------------------- learner payloads

    def send_payload(
        self, learner: LearnerId, fragment: FragmentIndex, sequence: int, payload: bytes, meta: dict[str, Any]
    ) -> str:
        """Upload a learner's payload, then its marker carrying ``meta``."""
        key = payload_key(learner, fragment, sequence)
        marker_meta = {**meta, "learner": learner, "fragment": fragment, "sequence": sequence, "bytes": len(payload)}
        self.store.put_marked(key, payload, self.marker(marker_meta), 4 * declared_values(payload))
        return key

    def payload_keys(self) -> list[str]:
        """Keys of every marked payload (fresh listing)."""
        return [key for key in self.store.list_marked("payloads") if PAYLOAD_KEY.match(key)]

    def relay_keys(self) -> list[str]:
        """Keys of every marked relayed payload (fresh listing)."""
        return [key for key in self.store.list_marked("relays") if RELAY_KEY.match(key)]

    def relay(self, key: str, payload: bytes) -> str:
        """Copy the payload at ``key`` (its bytes, as read and verified) and its marker to
        its relay key; the marker names the same learner, fragment and sequence, so it
        verifies there as it did here."""
        relayed = relay_key(key)
        self.store.put_marked(relayed, payload, self.store.get_marker(key), 4 * declared_values(payload))
        return relayed

    def payload_record(self, key: str) -> PayloadRecord:
        """A payload's (or a relayed payload's) verified marker.  Raises PayloadError when
        the marker is not authentic or describes another payload, FileNotFoundError when
        it is gone."""
        match = PAYLOAD_KEY.match(key) or RELAY_KEY.match(key)
        if not match:
            raise PayloadError(f"{key} is not a payload key")
        meta = self.marker_meta(key)
        named = (LearnerId(match["learner"]), int(match["fragment"]), int(match["sequence"]))
        if (meta.get("learner"), meta.get("fragment"), meta.get("sequence")) != named:
            raise PayloadError(f"the marker of {key} describes another payload")
        return PayloadRecord(
            key=key,
            learner=named[0],
            fragment=FragmentIndex(named[1]),
            sequence=named[2],
            base_version=Version(int(meta["base_version"])),
            c_steps=int(meta["c_steps"]),
            c_tokens=int(meta["c_tokens"]),
            meta=meta,
        )

    def read_payload(self, key: str) -> bytes:
        return self.store.get(key)

    def delete_payload(self, key: str) -> None:
        self.store.delete_marked(key)

    # ------------------------------------------------------- heartbeats and control

    def write_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.store.put_document(heartbeat_key(heartbeat.learner), heartbeat, self.secret)

    def read_heartbeat(self, learner: LearnerId) -> Heartbeat | None:
        """A learner's last heartbeat (None before its first; PayloadError when refused)."""
        beat = self.store.get_document(heartbeat_key(learner), Heartbeat, self._secret)
        if beat is not None and beat.learner != learner:
            raise PayloadError(f"{heartbeat_key(learner)} holds {beat.learner}'s heartbeat")
        return beat

    def write_control(self, learner: LearnerId, control: ControlNote) -> None:
        self.store.put_document(self.layout.control_key(learner), control, self.secret)

    def read_control(self, learner: LearnerId) -> ControlNote:
        """The syncer's note to ``learner`` (an empty note when there is none)."""
        key = self.layout.control_key(learner)
        return self.store.get_document(key, ControlNote, self.secret) or ControlNote()

    def read_epoch(self, learner: LearnerId) -> int:
        """How often ``learner`` has started (0 before its first start)."""
        record = self.store.get_document(epoch_key(learner), EpochRecord, self.secret)
        return record.epoch if record else 0

    def write_epoch(self, learner: LearnerId, epoch: int) -> None:
        """One process per learner reads and writes it, so that its send sequence
        numbers never repeat across restarts."""
        self.store.put_document(epoch_key(learner), EpochRecord(epoch=epoch), self.secret)

    # ------------------------------------------------------------------ checkpoints

    def write_checkpoint(self, learner: LearnerId, step: int, payload: bytes, keep: int = 2) -> None:
        """Upload a checkpoint (marked), then delete all but the newest ``keep`` (two
        while training: the older one is the fallback if the newer is damaged)."""
        key = checkpoint_key(learner, step)
        self.store.put_marked(key, payload, self.marker({"learner": learner, "step": step}))
        self.prune_checkpoints(learner, keep)

    def prune_checkpoints(self, learner: LearnerId, keep: int) -> None:
        for old in self.checkpoint_keys(learner)[:-keep]:
            self.store.delete_marked(old)

    def checkpoint_keys(self, learner: LearnerId) -> list[str]:
        """Marked checkpoints of ``learner``, oldest first."""
        return [key for key in self.store.list_marked(f"checkpoints/{learner}") if CHECKPOINT_KEY.match(key)]

    def read_checkpoint(self, key: str) -> bytes:
        return self.store.get(key)

    def drop_checkpoint(self, key: str) -> None:
        """Remove a refused checkpoint (marker first), so no later start picks it again."""
        self.store.delete_marked(key)

    # ------------------------------------------------------------- global weights

    def publish_update(self, version: Version, fragment: FragmentIndex, payload: bytes, replace: bool = False) -> bool:
        """Publish an update (payload, then marker).  Skipped when already published,
        unless ``replace`` (a damaged copy is being repaired); returns whether it wrote."""
        key = self.layout.update_key(version, fragment)
        if not replace and self.store.exists(key + ".ready"):  # a restarted syncer republishes
            return False
        self.store.put_marked(
            key, payload, self.marker({"version": version, "fragment": fragment}), 4 * declared_values(payload)
        )
        return True

    def read_update(self, version: Version, fragment: FragmentIndex) -> bytes:
        return self.store.get(self.layout.update_key(version, fragment))

    def update_versions(self) -> list[tuple[Version, FragmentIndex]]:
        return [
            (Version(int(match["version"])), FragmentIndex(int(match["fragment"])))
            for key in self.store.list_marked(self.layout.updates)
            if (match := self.layout.update_pattern.match(key))
        ]

    def delete_update(self, version: Version, fragment: FragmentIndex) -> None:
        self.store.delete_marked(self.layout.update_key(version, fragment))

    def write_snapshot(self, version: Version, payload: bytes, replace: bool = False) -> bool:
        key = self.layout.snapshot_key(version)
        if not replace and self.store.exists(key + ".ready"):
            return False
        self.store.put_marked(key, payload, self.marker({"version": version}), 4 * declared_values(payload))
        return True

    def read_snapshot(self, version: Version) -> bytes:
        return self.store.get(self.layout.snapshot_key(version))

    def snapshot_versions(self) -> list[Version]:
        return [
            Version(int(m["version"]))
            for key in self.store.list_marked(self.layout.snapshots)
            if (m := self.layout.snapshot_pattern.match(key))
        ]

    def delete_snapshot(self, version: Version) -> None:
        self.store.delete_marked(self.layout.snapshot_key(version))

    def write_head(self, head: Head) -> None:
        """The pointer to the newest version; written after the objects it names."""
        self.store.put_document(self.layout.head_key, head, self.secret)

    def read_head(self) -> Head | None:
        """The head (verified when this bucket holds the secret); PayloadError when refused."""
        return self.store.get_document(self.layout.head_key, Head, self._secret)

    def write_chaos_log(self, log: ChaosLog) -> None:
        self.store.put_document(CHAOS_KEY, log, self.secret)

    def read_chaos_log(self) -> ChaosLog | None:
        return self.store.get_document(CHAOS_KEY, ChaosLog, self._secret)

    def write_syncer_status(self, status: SyncerStatus) -> None:
        self.store.put_document(self.layout.status_key, status, self.secret)

    def read_syncer_status(self) -> SyncerStatus | None:
        return self.store.get_document(self.layout.status_key, SyncerStatus, self._secret)
