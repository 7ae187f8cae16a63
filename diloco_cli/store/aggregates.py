"""A region's reducer objects in its bucket: the aggregates it forwards, its own state.

Layout under the run's root, beside the learners' objects (docs/protocol.md)::

    aggregates/<fragment>-<serial>.dlc          a reducer's aggregate            (+ .ready)
    reducer/residuals/<fragment>-<serial>.dlc   its error feedback after it      (+ .ready)
    reducer/status.json                         what the reducer is doing        (sealed)
    control/reducer.epoch                       how often the reducer started    (sealed)

With syncer shards the region's reducer keeps one status and one epoch per shard
(``reducer/shard-<s>/status.json``, ``control/reducer.shard-<s>.epoch``): it reduces
each shard's fragments as that shard's own reducer.

An aggregate is one fragment's partial merge over some of the region's sends, anchored
at a version of that fragment; its marker names the sends it holds (payload key,
learner, sequence, base version, counters), the anchor, and the sends the reducer could
not anchor (their learners must resync).  The syncer reads only markers and aggregates
across the WAN; payloads stay in their region.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from diloco_cli.codec import PayloadError, declared_values
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.documents import ReducerStatus
from diloco_cli.store.region import AGGREGATE_KEY, RESIDUAL_KEY, RegionBucket


def reducer_of(region: str) -> LearnerId:
    """The name under which the syncer's ledger counts a region's aggregates: their
    serial numbers only grow, as a learner's sequence numbers do."""
    return LearnerId(f"reducer@{region}")


def aggregate_key(fragment: FragmentIndex, serial: int) -> str:
    return f"aggregates/{fragment:03d}-{serial:012d}.dlc"


def residual_key(fragment: FragmentIndex, serial: int) -> str:
    return f"reducer/residuals/{fragment:03d}-{serial:012d}.dlc"


@dataclass(frozen=True)
class SendRecord:
    """One learner send an aggregate holds, as the payload's marker described it."""

    key: str
    """The payload's key in the region's bucket."""
    learner: LearnerId
    sequence: int
    base_version: Version
    c_steps: int
    c_tokens: int

    def to_json(self) -> list:
        return [self.key, self.learner, self.sequence, self.base_version, self.c_steps, self.c_tokens]

    @classmethod
    def from_json(cls, entry: list) -> SendRecord:
        key, learner, sequence, base, steps, tokens = entry
        return cls(str(key), LearnerId(str(learner)), int(sequence), Version(int(base)), int(steps), int(tokens))


@dataclass(frozen=True)
class AggregateRecord:
    """A marked aggregate, as its authenticated marker describes it."""

    key: str
    fragment: FragmentIndex
    serial: int
    anchor: Version
    """The fragment's version its outer gradients are anchored at."""
    sends: tuple[SendRecord, ...]
    resync: tuple[SendRecord, ...]
    """Sends whose base the reducer could not anchor: their learners must resync."""
    meta: dict[str, Any]

    @property
    def made_at(self) -> float:
        """When the reducer read its sends (wall clock of the reducer's host)."""
        return float(self.meta.get("made_at", 0.0))


def write_aggregate(
    bucket: RegionBucket,
    fragment: FragmentIndex,
    serial: int,
    anchor: Version,
    sends: list[SendRecord],
    resync: list[SendRecord],
    payload: bytes,
) -> str:
    """Upload an aggregate, then its marker naming what it holds."""
    key = aggregate_key(fragment, serial)
    meta = {
        "fragment": fragment,
        "serial": serial,
        "anchor": anchor,
        "made_at": time.time(),
        "sends": [send.to_json() for send in sends],
        "resync": [send.to_json() for send in resync],
        "bytes": len(payload),
    }
    bucket.store.put_marked(key, payload, bucket.marker(meta), 4 * declared_values(payload))
    return key


def aggregate_keys(bucket: RegionBucket) -> list[str]:
    """Keys of every marked aggregate (fresh listing)."""
    return [key for key in bucket.store.list_marked("aggregates") if AGGREGATE_KEY.match(key)]


def aggregate_record(bucket: RegionBucket, key: str) -> AggregateRecord:
    """An aggregate's verified marker.  Raises PayloadError when it is not authentic or
    describes another aggregate, FileNotFoundError when it is gone."""
    match = AGGREGATE_KEY.match(key)
    if not match:
        raise PayloadError(f"{key} is not an aggregate key")
    meta = bucket.marker_meta(key)
    named = (int(match["fragment"]), int(match["serial"]))
    if (meta.get("fragment"), meta.get("serial")) != named:
        raise PayloadError(f"the marker of {key} describes another aggregate")
    try:
        sends = tuple(SendRecord.from_json(entry) for entry in meta["sends"])
        resync = tuple(SendRecord.from_json(entry) for entry in meta.get("resync", ()))
        anchor = Version(int(meta["anchor"]))
    except (KeyError, TypeError, ValueError) as error:
        raise PayloadError(f"the marker of {key} does not list its sends: {error}") from None
    return AggregateRecord(key, FragmentIndex(named[0]), named[1], anchor, sends, resync, meta)


def read_aggregate(bucket: RegionBucket, key: str) -> bytes:
    return bucket.store.get(key)


def delete_aggregate(bucket: RegionBucket, key: str) -> None:
    bucket.store.delete_marked(key)


def write_residual(bucket: RegionBucket, fragment: FragmentIndex, serial: int, payload: bytes) -> None:
    """The reducer's error feedback for ``fragment`` after its aggregate ``serial``."""
    key = residual_key(fragment, serial)
    bucket.store.put_marked(key, payload, bucket.marker({"fragment": fragment, "serial": serial}))


def residual_serials(bucket: RegionBucket) -> dict[FragmentIndex, list[int]]:
    """Per fragment, the serials of the residuals kept, oldest first."""
    found: dict[FragmentIndex, list[int]] = {}
    for key in bucket.store.list_marked("reducer/residuals"):
        if match := RESIDUAL_KEY.match(key):
            found.setdefault(FragmentIndex(int(match["fragment"])), []).append(int(match["serial"]))
    return {fragment: sorted(serials) for fragment, serials in found.items()}


def read_residual(bucket: RegionBucket, fragment: FragmentIndex, serial: int) -> bytes:
    return bucket.store.get(residual_key(fragment, serial))


def delete_residual(bucket: RegionBucket, fragment: FragmentIndex, serial: int) -> None:
    bucket.store.delete_marked(residual_key(fragment, serial))


def write_reducer_status(bucket: RegionBucket, status: ReducerStatus) -> None:
    bucket.store.put_document(bucket.layout.reducer_status_key, status, bucket.secret)


def read_reducer_status(bucket: RegionBucket) -> ReducerStatus | None:
    return bucket.store.get_document(bucket.layout.reducer_status_key, ReducerStatus, bucket.optional_secret)
