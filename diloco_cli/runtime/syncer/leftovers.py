"""Removing what killed writes and strangers leave in a run's buckets.

A process killed while writing leaves a ``.partial`` file (``file://``), an object
without its marker (a payload, checkpoint, update, snapshot, aggregate or reducer
residual: every kind of :data:`~diloco_cli.store.region.MARKED_KEYS`), or a marker whose
object was already removed; a person or a program may drop stray keys among the run's
objects.  None of these is ever read (only marked objects are), but they cost storage
forever.  The syncer lists each bucket now and then, remembers when it first saw each
leftover, and removes it once it has been there longer than any write in flight could
take (``sync.leftover_seconds``).  Ages come from the syncer's own clock, so clock skew
between machines and backends that report modification times differently do not matter.
"""

from __future__ import annotations

import logging
import re

from diloco_cli.store.objects import MARKER_SUFFIX, PARTIAL_SUFFIX, ObjectStore
from diloco_cli.store.region import MARKED_KEYS

log = logging.getLogger("diloco.syncer")

DOCUMENTS = (
    re.compile(r"^heartbeats/[^/]+\.json$"),
    re.compile(r"^control/[^/]+\.(json|epoch)$"),
    re.compile(r"^global/(shard-\d+/)?(head|syncer)\.json$"),
    re.compile(r"^global/shard-\d+/control/[^/]+\.json$"),
    re.compile(r"^reducer/(shard-\d+/)?status\.json$"),
)
OWNED_PREFIXES = ("payloads/", "checkpoints/", "global/", "heartbeats/", "control/", "aggregates/", "reducer/")
"""Where only diloco writes: anything else under these prefixes is a leftover."""
DELETE_BATCH = 1_000
"""Keys removed per request (S3's DeleteObjects takes at most 1,000)."""
MAX_REMOVALS_PER_SWEEP = 5_000
"""A flood of junk keys is removed over several sweeps of a few requests each, so that
no sweep holds up the syncer's loop for long."""


def leftovers(keys: list[str]) -> list[str]:
    """The keys of a run's root listing that no reader will ever use."""
    present = set(keys)
    found = []
    for key in keys:
        if key.endswith(PARTIAL_SUFFIX):
            found.append(key)
        elif key.endswith(MARKER_SUFFIX):
            target = key[: -len(MARKER_SUFFIX)]
            if target not in present or not any(pattern.match(target) for pattern in MARKED_KEYS):
                found.append(key)
        elif any(pattern.match(key) for pattern in MARKED_KEYS):
            if key + MARKER_SUFFIX not in present:
                found.append(key)
        elif key.startswith(OWNED_PREFIXES) and not any(pattern.match(key) for pattern in DOCUMENTS):
            found.append(key)
    return found


class LeftoverSweeper:
    """Removes leftovers from a store once they have been seen for ``after_seconds``."""

    def __init__(self, store: ObjectStore, after_seconds: float, only_partial: bool = False) -> None:
        self.store = store
        self.after_seconds = after_seconds
        self.only_partial = only_partial
        """For the syncer's home store, which has its own layout: only killed local writes."""
        self.first_seen: dict[str, float] = {}
        self.removed = 0

    def sweep(self, now: float, all_of_them: bool = False) -> None:
        """Remove the leftovers seen for ``after_seconds``; with ``all_of_them``, every
        leftover now (when the run has ended), but a ``.partial`` file first seen now: the
        learners are done, but another syncer shard or a reducer may be writing its last
        status (removed under it, its rename would fail)."""
        keys = self.store.list("", include_partial=True)
        found = [k for k in keys if k.endswith(PARTIAL_SUFFIX)] if self.only_partial else leftovers(keys)
        self.first_seen = {key: self.first_seen.get(key, now) for key in found}
        in_flight = {key for key, since in self.first_seen.items() if since == now and key.endswith(PARTIAL_SUFFIX)}
        due = [
            key
            for key, since in self.first_seen.items()
            if now - since >= self.after_seconds or (all_of_them and key not in in_flight)
        ]
        due = due if all_of_them else due[:MAX_REMOVALS_PER_SWEEP]
        for start in range(0, len(due), DELETE_BATCH):
            batch = due[start : start + DELETE_BATCH]
            self.store.delete_many(batch)
            oldest = max(now - self.first_seen.pop(key) for key in batch)
            self.removed += len(batch)
            shown = ", ".join(batch[:3]) + (f" and {len(batch) - 3} more" if len(batch) > 3 else "")
            log.info(
                "removed %d leftover(s) from %s (there for up to %.0f s): %s",
                len(batch),
                self.store.root,
                oldest,
                shown,
            )
