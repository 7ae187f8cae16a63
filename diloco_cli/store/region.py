"""A run's objects in one region's bucket: the layout and the operations on it.

Layout under the run's root (see docs/protocol.md)::

    manifest.json                                   the run: recipe, learners, regions
    payloads/<learner>/<fragment>-<sequence>.dlc    a learner's delta      (+ .ready)
    control/<learner>.epoch                         how often the learner started (mutable)
    heartbeats/<learner>.json                       a learner's heartbeat  (mutable)
    checkpoints/<learner>/<step>.dlc                a learner's checkpoint (+ .ready)
    control/<learner>.json                          the syncer's notes to a learner (mutable)
    global/updates/<version>-<fragment>.dlc         a published update     (+ .ready)
    global/snapshots/<version>.dlc                  full global weights    (+ .ready)
    global/head.json                                newest version, recent updates (mutable)
    global/syncer.json                              the syncer's status    (mutable)

Immutable objects (``.dlc``) are written first and their marker last, and read only when
marked; markers are authenticated metadata frames.  Mutable objects are small JSON
documents written whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diloco_cli.codec import CodecSpec, PayloadError, RunSecret, encode_payload, read_header
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.objects import ObjectStore

MARKER_SPEC = CodecSpec(zstd_level=0)
PAYLOAD_KEY = re.compile(r"^payloads/(?P<learner>[^/]+)/(?P<fragment>\d{3})-(?P<sequence>\d{12})\.dlc$")
UPDATE_KEY = re.compile(r"^global/updates/(?P<version>\d{10})-(?P<fragment>\d{3})\.dlc$")
SNAPSHOT_KEY = re.compile(r"^global/snapshots/(?P<version>\d{10})\.dlc$")
CHECKPOINT_KEY = re.compile(r"^checkpoints/[^/]+/(?P<step>\d{10})\.dlc$")


def payload_key(learner: LearnerId, fragment: FragmentIndex, sequence: int) -> str:
    return f"payloads/{learner}/{fragment:03d}-{sequence:012d}.dlc"


def update_key(version: Version, fragment: FragmentIndex) -> str:
    return f"global/updates/{version:010d}-{fragment:03d}.dlc"


def snapshot_key(version: Version) -> str:
    return f"global/snapshots/{version:010d}.dlc"


def checkpoint_key(learner: LearnerId, step: int) -> str:
    return f"checkpoints/{learner}/{step:010d}.dlc"


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

    def __init__(self, name: str, root: str, storage_options: dict[str, Any] | None, secret: RunSecret | None) -> None:
        self.name = name
        self.store = ObjectStore(root, storage_options)
        self._secret = secret

    def __repr__(self) -> str:
        return f"RegionBucket({self.name!r}, {self.store.root!r})"

    @property
    def secret(self) -> RunSecret:
        if self._secret is None:
            raise RuntimeError("this operation needs the run's secret")
        return self._secret

    def _marker(self, meta: dict[str, Any]) -> bytes:
        return encode_payload([], MARKER_SPEC, self.secret, meta)

    def _marker_meta(self, key: str) -> dict[str, Any]:
        return read_header(self.store.get_marker(key), self.secret).meta

    # ---------------------------------------------------------------- run manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.store.put_json("manifest.json", manifest)

    def read_manifest(self) -> dict[str, Any] | None:
        return self.store.get_json("manifest.json")

    # -------------------------------------------------------------- learner payloads

    def send_payload(self, learner: LearnerId, fragment: FragmentIndex, sequence: int, payload: bytes, meta: dict[str, Any]) -> str:
        """Upload a learner's payload, then its marker carrying ``meta``."""
        key = payload_key(learner, fragment, sequence)
        marker_meta = {**meta, "learner": learner, "fragment": fragment, "sequence": sequence, "bytes": len(payload)}
        self.store.put_marked(key, payload, self._marker(marker_meta))
        return key

    def payload_keys(self) -> list[str]:
        """Keys of every marked payload (fresh listing)."""
        return [key for key in self.store.list_marked("payloads") if PAYLOAD_KEY.match(key)]

    def payload_record(self, key: str) -> PayloadRecord:
        """A payload's verified marker.  Raises PayloadError when the marker is not
        authentic or describes another payload, FileNotFoundError when it is gone."""
        match = PAYLOAD_KEY.match(key)
        if not match:
            raise PayloadError(f"{key} is not a payload key")
        meta = self._marker_meta(key)
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

    def write_heartbeat(self, learner: LearnerId, heartbeat: dict[str, Any]) -> None:
        self.store.put_json(f"heartbeats/{learner}.json", heartbeat)

    def read_heartbeats(self) -> dict[LearnerId, dict[str, Any]]:
        beats = {}
        for key in self.store.list("heartbeats"):
            if key.endswith(".json"):
                beat = self.store.get_json(key)
                if isinstance(beat, dict):
                    beats[LearnerId(key[len("heartbeats/") : -len(".json")])] = beat
        return beats

    def write_control(self, learner: LearnerId, control: dict[str, Any]) -> None:
        self.store.put_json(f"control/{learner}.json", control)

    def read_control(self, learner: LearnerId) -> dict[str, Any]:
        return self.store.get_json(f"control/{learner}.json") or {}

    def next_epoch(self, learner: LearnerId) -> int:
        """Count this start of a learner (one process per learner reads and writes it), so
        that send sequence numbers never repeat across restarts."""
        key = f"control/{learner}.epoch"
        record = self.store.get_json(key) or {"epoch": 0}
        epoch = int(record["epoch"]) + 1
        self.store.put_json(key, {"epoch": epoch})
        return epoch

    # ------------------------------------------------------------------ checkpoints

    def write_checkpoint(self, learner: LearnerId, step: int, payload: bytes, keep: int = 2) -> None:
        """Upload a checkpoint (marked), then delete all but the newest ``keep``."""
        key = checkpoint_key(learner, step)
        self.store.put_marked(key, payload, self._marker({"learner": learner, "step": step}))
        for old in self.checkpoint_keys(learner)[:-keep]:
            self.store.delete_marked(old)

    def checkpoint_keys(self, learner: LearnerId) -> list[str]:
        return [key for key in self.store.list_marked(f"checkpoints/{learner}") if CHECKPOINT_KEY.match(key)]

    def latest_checkpoint(self, learner: LearnerId) -> bytes | None:
        keys = self.checkpoint_keys(learner)
        return self.store.get(keys[-1]) if keys else None

    # ------------------------------------------------------------- global weights

    def publish_update(self, version: Version, fragment: FragmentIndex, payload: bytes) -> None:
        key = update_key(version, fragment)
        if not self.store.exists(key + ".ready"):  # idempotent when a restarted syncer republishes
            self.store.put_marked(key, payload, self._marker({"version": version, "fragment": fragment}))

    def read_update(self, version: Version, fragment: FragmentIndex) -> bytes:
        return self.store.get(update_key(version, fragment))

    def update_versions(self) -> list[tuple[Version, FragmentIndex]]:
        return [
            (Version(int(match["version"])), FragmentIndex(int(match["fragment"])))
            for key in self.store.list_marked("global/updates")
            if (match := UPDATE_KEY.match(key))
        ]

    def delete_update(self, version: Version, fragment: FragmentIndex) -> None:
        self.store.delete_marked(update_key(version, fragment))

    def write_snapshot(self, version: Version, payload: bytes) -> None:
        key = snapshot_key(version)
        if not self.store.exists(key + ".ready"):
            self.store.put_marked(key, payload, self._marker({"version": version}))

    def read_snapshot(self, version: Version) -> bytes:
        return self.store.get(snapshot_key(version))

    def snapshot_versions(self) -> list[Version]:
        return [Version(int(m["version"])) for key in self.store.list_marked("global/snapshots") if (m := SNAPSHOT_KEY.match(key))]

    def delete_snapshot(self, version: Version) -> None:
        self.store.delete_marked(snapshot_key(version))

    def write_head(self, head: dict[str, Any]) -> None:
        """The pointer to the newest version; written after the objects it names."""
        self.store.put_json("global/head.json", head)

    def read_head(self) -> dict[str, Any] | None:
        return self.store.get_json("global/head.json")

    def write_syncer_status(self, status: dict[str, Any]) -> None:
        self.store.put_json("global/syncer.json", status)

    def read_syncer_status(self) -> dict[str, Any] | None:
        return self.store.get_json("global/syncer.json")
