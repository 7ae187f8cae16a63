"""Every storage call counted: by kind of object, with bytes, requests and seconds.

A process meters each store it talks to (a learner its region's bucket; the syncer every
region's bucket and its home).  The store's region and the process's place name the
*link* the bytes crossed; ``diloco report`` turns the counts into a table per link, per
learner and per kind (docs/bandwidth.md).  Counts live in the process's own reports (a
learner's heartbeat, the syncer's status) and each start adds to the counts of the last
report, so a restarted process does not reset them.

Listings have no body the backends hand back, so their bytes are estimated from the keys
listed (:data:`LISTING_BYTES_PER_REQUEST`, :data:`LISTING_BYTES_PER_KEY`); every other
object byte is the size of an object written or read.  What each request carries
besides (HTTP heads, error bodies, protocol envelopes) is counted apart, as *overhead*,
estimated per request by :mod:`diloco_cli.store.wire`; the *wire* bytes are both, what a
link carries and what reports show.
"""

from __future__ import annotations

import threading
import time

from pydantic import BaseModel, ConfigDict, Field

KINDS = (
    "payload",
    "aggregate",
    "update",
    "snapshot",
    "checkpoint",
    "marker",
    "head",
    "status",
    "heartbeat",
    "control",
    "listing",
    "manifest",
    "reducer",
    "home",
    "other",
)
"""The kinds of storage traffic, in the order reports show them."""

LISTING_BYTES_PER_REQUEST = 300
"""Estimated bytes of a listing answer besides its entries: an S3 ListObjectsV2 answer's
XML declaration and ``<ListBucketResult>`` with Name, Prefix, KeyCount, MaxKeys and
IsTruncated.  HTTP headers are not counted (nor for any other request)."""

LISTING_BYTES_PER_KEY = 210
"""Estimated bytes per listed object besides its key: an S3 ``<Contents>`` element with
LastModified, ETag, Size and StorageClass.  Measured against moto: 20 keys of 44
characters took 5,450 bytes of body (300 + 20 x (210 + 44) = 5,380).  GCS's JSON listing
is larger per object (about 600 bytes), Azure's XML about the same as S3's."""

LIST_PAGE_KEYS = 1000
"""Keys per listing request (S3's MaxKeys; GCS and Azure page similarly)."""


def listing_bytes(keys: list[str]) -> int:
    """The estimated size of the listing answers that name ``keys``."""
    pages = max(1, -(-len(keys) // LIST_PAGE_KEYS))
    return pages * LISTING_BYTES_PER_REQUEST + sum(LISTING_BYTES_PER_KEY + len(key) for key in keys)


class Traffic(BaseModel):
    """Calls of one kind to one store."""

    model_config = ConfigDict(extra="forbid")

    requests: int = 0
    """Calls made (each retry counts again)."""
    writes: int = 0
    """Of these, writes and listings (billed as PUT/LIST, "class A", by the providers)."""
    deletes: int = 0
    """Of these, deletions (free); the rest are reads (GET/HEAD, "class B")."""
    bytes_up: int = 0
    """Bytes written to the store."""
    bytes_down: int = 0
    """Bytes read from it (listings: estimated)."""
    seconds: float = 0.0
    """Time spent in these calls, summed over threads."""
    raw_bytes: int = 0
    """For tensor objects written: the fp32 bytes of the tensors they carry (what the
    codec compressed)."""
    overhead_up: int = 0
    """Sent besides the objects: request heads and envelopes (estimated per request)."""
    overhead_down: int = 0
    """Received besides the objects: response heads, error bodies (estimated per request)."""

    @property
    def wire_up(self) -> int:
        """Every byte sent: objects and overhead."""
        return self.bytes_up + self.overhead_up

    @property
    def wire_down(self) -> int:
        """Every byte received: objects and overhead."""
        return self.bytes_down + self.overhead_down

    def plus(self, other: Traffic) -> Traffic:
        return Traffic(**{name: getattr(self, name) + getattr(other, name) for name in Traffic.model_fields})


TrafficSample = tuple[float, int, int]
"""(time, wire bytes up, wire bytes down): bytes moved up to ``time`` since the process's
first start (a plain triple: heartbeats carry a hundred of them every few seconds)."""


class StorageCounters(BaseModel):
    """What one process's storage calls to one store did (persisted in its reports)."""

    model_config = ConfigDict(extra="forbid")

    kinds: dict[str, Traffic] = Field(default_factory=dict)
    """Requests, bytes and seconds by kind of object."""
    retries: int = 0
    """Calls that failed transiently and were tried again."""
    failures: int = 0
    """Calls that still failed after every try."""
    last_error: str | None = None
    last_error_time: float | None = None
    history: list[TrafficSample] = Field(default_factory=list)
    """Bytes moved over time (at most :data:`MAX_SAMPLES`, thinned evenly)."""

    @property
    def total(self) -> Traffic:
        total = Traffic()
        for traffic in self.kinds.values():
            total = total.plus(traffic)
        return total

    @property
    def requests(self) -> int:
        return self.total.requests

    @property
    def bytes_up(self) -> int:
        return self.total.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.total.bytes_down

    @property
    def wire_up(self) -> int:
        return self.total.wire_up

    @property
    def wire_down(self) -> int:
        return self.total.wire_down

    def plus(self, other: StorageCounters) -> StorageCounters:
        """The sum of two counts: ``self`` from before a restart, ``other`` since (the
        latest error wins; the history continues from ``self``'s totals)."""
        newer = other if (other.last_error_time or 0) >= (self.last_error_time or 0) else self
        kinds = {
            kind: self.kinds.get(kind, Traffic()).plus(other.kinds.get(kind, Traffic()))
            for kind in KINDS
            if kind in self.kinds or kind in other.kinds
        }
        before = self.total
        history = self.history + [
            (when, before.wire_up + up, before.wire_down + down) for when, up, down in other.history
        ]
        return StorageCounters(
            kinds=kinds,
            retries=self.retries + other.retries,
            failures=self.failures + other.failures,
            last_error=newer.last_error,
            last_error_time=newer.last_error_time,
            history=thinned(history),
        )


MAX_SAMPLES = 120
"""History samples kept per store; beyond it every other older sample is dropped."""

SAMPLE_SECONDS = 10.0
"""The least time between two history samples."""


def thinned(history: list[TrafficSample], limit: int = MAX_SAMPLES) -> list[TrafficSample]:
    """At most ``limit`` samples: every other one dropped until it fits (the newest kept)."""
    while len(history) > limit:
        history = history[-1::-2][::-1]
    return history


class StorageMeter:
    """Thread-safe counters of one store's calls (storage I/O runs on several threads)."""

    def __init__(self) -> None:
        self._counters = StorageCounters()
        self._lock = threading.Lock()

    def snapshot(self) -> StorageCounters:
        """The counts now, with a history sample of this moment: the newest sample is always
        the present totals (a plot of the history ends at the table's figures), the ones
        before it at least :data:`SAMPLE_SECONDS` apart."""
        with self._lock:
            counters = self._counters
            now = time.time()
            total = counters.total
            sample = (round(now, 1), total.wire_up, total.wire_down)
            history = counters.history
            if len(history) >= 2 and history[-1][0] - history[-2][0] < SAMPLE_SECONDS:
                history = history[:-1]  # the newest moves on to now until it is far enough from the one before
            counters.history = thinned([*history, sample])
            return counters.model_copy(deep=True)

    def count(
        self,
        kind: str,
        *,
        requests: int = 0,
        op: str = "read",
        up: int = 0,
        down: int = 0,
        seconds: float = 0.0,
        raw: int = 0,
        overhead: tuple[int, int] = (0, 0),
    ) -> None:
        """Add to ``kind``'s counts; ``op`` (``read``, ``write``, ``list``, ``delete``)
        classes the requests for pricing; ``overhead``: (up, down) bytes besides objects."""
        with self._lock:
            traffic = self._counters.kinds.setdefault(kind, Traffic())
            traffic.requests += requests
            if op in ("write", "list"):
                traffic.writes += requests
            elif op == "delete":
                traffic.deletes += requests
            traffic.bytes_up += up
            traffic.bytes_down += down
            traffic.seconds += seconds
            traffic.raw_bytes += raw
            traffic.overhead_up += overhead[0]
            traffic.overhead_down += overhead[1]

    def retried(self) -> None:
        with self._lock:
            self._counters.retries += 1

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self._counters.failures += 1
            self._counters.last_error = f"{type(error).__name__}: {error}"[:300]
            self._counters.last_error_time = time.time()
