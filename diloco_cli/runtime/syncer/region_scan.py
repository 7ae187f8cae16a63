"""One turn's look at one region's bucket: what arrived (marker and bytes) and heartbeats.

What arrives is the region's reducer's aggregates (``store.aggregates``, under K = M) and
the learners' payloads it relays (under K < M).  The syncer scans every region at once
(:mod:`diloco_cli.runtime.syncer.fanout`): a scan only reads and deletes objects and
returns what it found; the syncer takes the findings in on its own thread.  An arrival's
bytes are read as soon as its marker is seen, so over a WAN the download overlaps the
wait for a quorum instead of delaying the merge (they are verified when merged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from diloco_cli.codec import PayloadError
from diloco_cli.core.ledger import PayloadId
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.store import aggregates
from diloco_cli.store.aggregates import AGGREGATE_KEY, AggregateRecord, reducer_of
from diloco_cli.store.documents import Heartbeat, ReducerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import PAYLOAD_KEY, RELAY_KEY, PayloadRecord, RegionBucket

log = logging.getLogger("diloco.syncer")


def qualified(region: str, key: str) -> str:
    """A key made unique across regions (the form the ledger stores)."""
    return f"{region}:{key}"


def payload_id(name: str) -> PayloadId | None:
    """The ledger's identity of a qualified payload or aggregate key (None: neither).  A
    region's aggregates count under its reducer's name, their serials as sequences; a
    relayed payload is the learner's send it copies."""
    region, key = name.split(":", 1)
    if match := PAYLOAD_KEY.match(key) or RELAY_KEY.match(key):
        return PayloadId(
            name, LearnerId(match["learner"]), FragmentIndex(int(match["fragment"])), int(match["sequence"])
        )
    if match := AGGREGATE_KEY.match(key):
        return PayloadId(name, reducer_of(region), FragmentIndex(int(match["fragment"])), int(match["serial"]))
    return None


Record = PayloadRecord | AggregateRecord


@dataclass
class RegionScan:
    """What one turn found in one region's bucket."""

    region: str
    records: list[Record] = field(default_factory=list)
    """Verified markers of arrivals not seen before."""
    payloads: dict[str, bytes] = field(default_factory=dict)
    """The bytes of those arrivals, by key (verified when merged)."""
    refused: list[tuple[str, PayloadError]] = field(default_factory=list)
    """Keys whose marker is not authentic."""
    heartbeats: list[tuple[LearnerId, Heartbeat | PayloadError | None]] = field(default_factory=list)
    """The heartbeats of the learners asked for (None before a learner's first)."""
    reducer: ReducerStatus | PayloadError | None = None
    """The region's reducer's status, when asked for (None: none written yet)."""
    unreachable: str | None = None
    """Why the bucket could not be listed (the scan stopped there), or None."""
    whole: bool = True
    """Whether the scan saw everything it looked for (no storage call failed)."""
    published_missing: list[str] = field(default_factory=list)
    """Of the keys the syncer's publication left (looked for with the heartbeats),
    those gone: the bucket was wiped and recreated, or they were deleted."""


def scan_region(
    bucket: RegionBucket,
    learners: list[LearnerId],
    *,
    known: Callable[[str], bool],
    consumed: Callable[[str], bool],
    owns: Callable[[FragmentIndex], bool] = lambda fragment: True,
    published: Sequence[str] = (),
) -> RegionScan:
    """List a region's arrivals (its reducer's aggregates and the payloads it relays) of
    the fragments this syncer ``owns`` (a syncer shard's), delete the relays the ledger
    says are consumed, read the markers and bytes of those not ``known`` yet, the
    heartbeats of ``learners`` and, with them, which of the ``published`` keys are gone
    and the reducer's status.  A storage failure ends the look at the arrivals
    (what was seen before it is kept, the rest comes on a later turn); one of the
    listing ends the scan (``unreachable``)."""
    region, scan = bucket.name, RegionScan(bucket.name)
    try:
        keys = aggregates.aggregate_keys(bucket) + bucket.relay_keys()
    except StorageError as error:
        log.warning("region %s cannot be listed now: %s", region, error)
        scan.unreachable, scan.whole = str(error), False
        return scan
    for key in keys:
        name = qualified(region, key)
        if not owns(payload_id(name).fragment):
            continue
        try:
            relayed = RELAY_KEY.match(key) is not None
            if consumed(name):
                if relayed:  # a relayed copy is the syncer's to delete (an aggregate, its reducer's)
                    bucket.delete_payload(key)
                continue
            if known(name):
                continue
            scan.records.append(bucket.payload_record(key) if relayed else aggregates.aggregate_record(bucket, key))
            scan.payloads[key] = bucket.read_payload(key)
        except FileNotFoundError:
            continue
        except PayloadError as error:
            scan.refused.append((key, error))
        except StorageError as error:
            log.warning("region %s: arrivals after %s wait for a later turn: %s", region, key, error)
            scan.whole = False
            break
    for learner in learners:
        try:
            scan.heartbeats.append((learner, bucket.read_heartbeat(learner)))
        except PayloadError as error:
            scan.heartbeats.append((learner, error))
        except StorageError as error:
            log.warning("region %s: heartbeat of %s cannot be read now: %s", region, learner, error)
            scan.whole = False
    if learners:
        try:
            scan.published_missing = missing(bucket, published)
        except StorageError as error:
            log.warning("region %s: what the syncer published cannot be looked for now: %s", region, error)
            scan.whole = False
    if learners:
        try:
            scan.reducer = aggregates.read_reducer_status(bucket)
        except PayloadError as error:
            scan.reducer = error
        except StorageError as error:
            log.warning("region %s: its reducer's status cannot be read now: %s", region, error)
            scan.whole = False
    return scan


def missing(bucket: RegionBucket, keys: Sequence[str]) -> list[str]:
    """The ``keys`` the region's bucket does not hold (StorageError when it cannot say)."""
    return [key for key in keys if not bucket.store.exists(key)]
