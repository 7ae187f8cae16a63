"""The region's copy of the global weights, kept up with the head by its reducer.

At the first head it reads, the reducer builds the copy (:class:`~.replica.GlobalReplica`)
from the newest snapshot the region holds that verifies, else version 0 from the recipe's
seed, refused when it is not the syncer's bit for bit.  At every turn after, the copy adds
the updates the head lists that it lacks; a missing one (the region was cut off while it
was published and it is kept nowhere any more) makes it wait, and after
:data:`GAP_SECONDS` ask the syncer for a snapshot (``needs_snapshot`` in the reducer's
status), from which it starts again.  The copy writes the region's snapshots (at the
head's snapshot version, and again when the region's learners report one damaged) and
removes what no reader needs any more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from diloco_cli.codec import CorruptPayload, PayloadError
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.coordinator import RefusalCount
from diloco_cli.runtime.reducer.replica import GlobalReplica, ReplicaGap
from diloco_cli.store.documents import Head, Heartbeat
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import RegionBucket

log = logging.getLogger("diloco.reducer")

GAP_SECONDS = 10.0
"""How long the region's copy waits for a missing update before it asks for a snapshot."""


@dataclass(frozen=True)
class VersionZero:
    """The model as the recipe's seed builds it in every region: its fragments, those this
    reducer keeps (a syncer shard's, ``owned``) and its weights (version 0)."""

    fragments: tuple[Fragment, ...]
    owned: tuple[Fragment, ...]
    weights: Mapping[str, torch.Tensor]


class RegionCopy:
    """The region's copy of the global weights (of one syncer shard's fragments, ``owned``):
    :meth:`build` once a head is read, then :meth:`follow` each head."""

    def __init__(
        self,
        bucket: RegionBucket,
        model: VersionZero,
        window_versions: int,
        refusals: RefusalCount,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bucket, self.secret, self.fragments, self.owned = bucket, bucket.secret, model.fragments, model.owned
        self.initial = model.weights
        """Version 0, built from the recipe's seed."""
        self.window_versions, self.refusals, self.clock = window_versions, refusals, clock
        self.replica: GlobalReplica | None = None
        self.initial_weights = "unchecked"
        """Whether version 0 built here is the syncer's: ``match``, ``differ`` (the reducer
        refuses to reduce), or ``unchecked`` before the first head."""
        self.snapshot_version = Version(-1)
        """The newest snapshot the copy wrote."""
        self.damaged_snapshots: set[Version] = set()
        """Snapshot versions the region's learners reported refusing (damaged or missing)."""
        self.reported: set[tuple[LearnerId, str, float]] = set()
        """Learners' refusal notes already taken in (their heartbeats repeat them)."""
        self.gap_since: float | None = None
        """Since when the copy cannot add the next update (one is missing)."""

    @property
    def versions(self) -> Mapping[FragmentIndex, Version]:
        """The version each fragment of the copy is at."""
        return self.replica.versions

    @property
    def needs_snapshot(self) -> bool:
        """Whether the copy has waited for a missing update long enough that the syncer
        should give the region a snapshot (the region missed updates during an outage that
        are no longer kept anywhere)."""
        return self.gap_since is not None and self.clock() - self.gap_since >= GAP_SECONDS

    def build(self, head: Head) -> bool:
        """The copy: from the newest snapshot this region holds that verifies, else version 0
        built here; False when that is not the syncer's (the reducer refuses to reduce)."""
        for version in sorted(self.bucket.snapshot_versions(), reverse=True):
            try:
                payload = self.bucket.read_snapshot(version)
                self.replica = GlobalReplica.from_snapshot(
                    self.fragments, payload, self.bucket, self.secret, self.window_versions
                )
                self.initial_weights = "match"
                log.info("the region's copy starts from its snapshot of version %d", version)
                return True
            except (PayloadError, FileNotFoundError) as error:
                self.refusals.refused("snapshot", self.bucket.layout.snapshot_key(version), error)
        try:
            self.replica = GlobalReplica.initial(
                self.fragments, self.initial, head, self.bucket, self.secret, self.window_versions, self.owned
            )
        except CorruptPayload as error:
            if self.initial_weights != "differ":
                log.error("refusing to reduce: %s", error)
            self.initial_weights = "differ"
            return False
        self.initial_weights = "match"
        if not self.bucket.snapshot_versions():  # a learner that cannot build version 0 itself reads it here
            self.bucket.write_snapshot(Version(0), self.replica.snapshot())
            self.snapshot_version = Version(0)
        log.info("the region's copy starts from version 0, built here from the recipe's seed")
        return True

    def follow(self, head: Head) -> None:
        """Bring the copy up to the head, writing the snapshots that fall due."""
        replica = self.replica
        try:
            if head.version > replica.version:
                for version, fragment in replica.pending(head):
                    self._add(version, fragment)
                    self._snapshot_if_due(head)
            replica.check(head)
            self.gap_since = None
        except ReplicaGap as error:
            if self.gap_since is None:
                self.gap_since = self.clock()
                log.info("the region's copy waits at version %d: %s", replica.version, error)
            self._start_again_from_a_newer_snapshot()
        except (PayloadError, StorageError) as error:
            log.warning("the region's copy stays at version %d: %s", replica.version, error)
        self._snapshot_if_due(head)

    def take_in_notes(self, learner: LearnerId, beat: Heartbeat) -> None:
        """The region's snapshots a learner reports refusing (its heartbeats repeat them):
        written again once the copy is at (or past) their version."""
        for note in beat.refusals.recent:
            seen = (learner, note.key, note.time)
            match = self.bucket.layout.snapshot_pattern.match(note.key)
            if note.kind == "snapshot" and match and seen not in self.reported:
                self.reported.add(seen)
                self.damaged_snapshots.add(Version(int(match["version"])))

    def _add(self, version: Version, fragment: FragmentIndex) -> None:
        """One update into the copy; a damaged one is reported (in the reducer's status:
        the syncer rewrites it from its commits) and stops the copy there."""
        try:
            self.replica.add(version, fragment)
        except PayloadError as error:
            self.refusals.refused("update", self.bucket.layout.update_key(version, fragment), error)
            raise

    def _start_again_from_a_newer_snapshot(self) -> None:
        """A snapshot in the region newer than the copy (the syncer's, after a gap) that
        holds every fragment at or past the copy's version: the copy starts again from it."""
        replica = self.replica
        for version in sorted((v for v in self.bucket.snapshot_versions() if v > replica.version), reverse=True):
            try:
                newer = GlobalReplica.from_snapshot(
                    self.fragments,
                    self.bucket.read_snapshot(version),
                    self.bucket,
                    self.secret,
                    replica.window_versions,
                )
            except (PayloadError, FileNotFoundError) as error:
                self.refusals.refused("snapshot", self.bucket.layout.snapshot_key(version), error)
                continue
            if all(newer.versions.get(p, -1) >= v for p, v in replica.versions.items()):
                log.info("the region's copy starts again from the snapshot of version %d", version)
                self.replica, self.gap_since = newer, None
                return

    def _snapshot_if_due(self, head: Head) -> None:
        """The region's snapshot at the head's snapshot version, once the copy is there;
        then the old ones go.  A snapshot the region's learners refused is written again
        when the copy is at its version, else one of the copy's present is written (readers
        take the newest snapshot the head's updates cover)."""
        replica = self.replica
        version = head.snapshot_version
        if replica.version == version and version > self.snapshot_version:
            self._write_snapshot(head, replace=False)
        if self.damaged_snapshots and replica.version >= max(self.damaged_snapshots):
            self._write_snapshot(head, replace=replica.version in self.damaged_snapshots)
            self.damaged_snapshots.clear()

    def _write_snapshot(self, head: Head, replace: bool) -> None:
        version = self.replica.version
        self.bucket.write_snapshot(version, self.replica.snapshot(), replace=replace)
        self.snapshot_version = max(self.snapshot_version, version)
        log.info("wrote the region's snapshot of version %d", version)
        self._collect_garbage(head)

    def _collect_garbage(self, head: Head) -> None:
        """Drop what no reader needs: snapshots before the head's ``recent_from`` (the one
        before the newest stays, as a fallback), and updates at or before it that are not
        among the last W of their fragment (the window anchors with them)."""
        window = {(v, p) for p, w in self.replica.windows.items() for v in w.versions}
        for version, fragment in self.bucket.update_versions():
            if version <= head.recent_from and (version, fragment) not in window:
                self.bucket.delete_update(version, fragment)
        for version in self.bucket.snapshot_versions():
            if version < head.recent_from:
                self.bucket.delete_snapshot(version)
