"""Publishing the global weights to every region, and keeping what was published whole.

One upload per region and merge (the WAN cost), then the head; every region at once
(:mod:`diloco_cli.runtime.syncer.fanout`).  Each region's reducer writes the region's
snapshots from the updates; the syncer gives a region a snapshot only when it lost its
copy (a wiped bucket, updates missed that no one keeps any more).  A region whose bucket
cannot be written is *behind*: the merge is already committed, so nothing is lost, and
the region is caught up (missing updates, the head) on a later turn of the syncer's
loop.  When a learner reports a published object it refused (a damaged update, a head
that does not verify), the syncer checks the object and rewrites it from its own
commits; published objects are never trusted just because their marker exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diloco_cli.codec import PayloadError, RunSecret, read_header
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.runtime.syncer.context import SyncerContext
from diloco_cli.store.documents import Head, RefusalNote
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import SyncerHome
from diloco_cli.store.region import RegionBucket

log = logging.getLogger("diloco.syncer")


CATCH_UP_SECONDS = 5.0
"""How often regions that missed a publication are tried again."""
GIVE_SNAPSHOT_SECONDS = 30.0
"""How often a region whose reducer asks for a snapshot may be given one."""


class Publication:
    """The syncer's side of the global objects in every region's bucket.

    ``head`` and ``snapshot`` give the head and the snapshot payload of the syncer's
    weights as they are now (what a region that is behind is given)."""

    def __init__(self, context: SyncerContext, head: Callable[[], Head], snapshot: Callable[[], bytes]) -> None:
        self.buckets: dict[str, RegionBucket] = context.buckets
        self.home: SyncerHome = context.home
        self.secret: RunSecret = context.secret
        self.fanout = context.fanout
        self.head, self.snapshot = head, snapshot
        self.behind: set[str] = set()
        """Regions that missed a publication and must be caught up."""
        self.repairs = 0
        self._handled: set[tuple[str, str, float]] = set()
        self._last_catch_up = float("-inf")
        self._given: dict[str, float] = {}

    def mark_behind(self, region: str) -> None:
        """The region missed (or will miss) a publication: catch it up later."""
        self.behind.add(region)

    def catch_up_soon(self) -> None:
        """Try the regions that are behind at the next :meth:`catch_up_if_due`."""
        self._last_catch_up = float("-inf")

    def publish(self, version: Version, fragment: FragmentIndex, payload: bytes) -> None:
        """The update to every region that is not behind, then the head (each region's
        reducer writes the region's snapshots: the syncer only names their versions)."""
        head = self.head()

        def publish_to(name: str) -> StorageError | None:
            bucket = self.buckets[name]
            try:
                bucket.publish_update(version, fragment, payload)
                bucket.write_head(head)
            except StorageError as error:
                return error
            return None

        regions = [name for name in self.buckets if name not in self.behind]
        for name, error in zip(regions, self.fanout.each(publish_to, regions)):
            if error is not None:
                log.warning("region %s missed version %d (%s); it will be caught up", name, version, error)
                self.behind.add(name)

    def catch_up_if_due(self, now: float, unreachable: set[str]) -> None:
        """Every :data:`CATCH_UP_SECONDS`, catch up the regions behind that can be reached."""
        behind = self.behind - unreachable
        if behind and now - self._last_catch_up >= CATCH_UP_SECONDS:
            self.catch_up(behind)
            self._last_catch_up = now

    def catch_up(self, names: set[str]) -> None:
        """Give each region in ``names`` every update the head lists, then the head
        (writing an immutable object that is already there is skipped)."""
        head = self.head()
        for name in sorted(names):
            bucket = self.buckets[name]
            try:
                for version, fragment in head.recent:
                    bucket.publish_update(version, fragment, self.home.read_update(version))
                bucket.write_head(head)
                self.behind.discard(name)
                log.info("region %s is caught up at version %d", name, head.version)
            except StorageError as error:
                self.behind.add(name)
                log.warning("region %s is still behind (%s)", name, error)

    def restore(self, region: str, updates: list[tuple[Version, FragmentIndex]]) -> None:
        """Give a region whose head vanished (its bucket wiped and recreated) what it
        lost: a snapshot of the present (the region's copy cannot be rebuilt from updates
        no one holds there any more), ``updates`` (those its learners
        and reducer need to anchor their next sends and catch up:
        :func:`~diloco_cli.core.decisions.updates_to_restore`), then the head.  Tried again
        at the next look while the head is still missing."""
        head, bucket = self.head(), self.buckets[region]
        try:
            bucket.write_snapshot(head.version, self.snapshot(), replace=True)
            for version, fragment in updates:  # over any marker a write cut by the wipe left
                bucket.publish_update(version, fragment, self.home.read_update(version), replace=True)
            bucket.write_head(head)
        except StorageError as error:
            log.warning("region %s lost its head and could not be restored yet (tried again): %s", region, error)
            return
        self.behind.discard(region)
        log.warning(
            "region %s lost its head and updates (was its bucket wiped?): gave it a snapshot of version %d, "
            "%d updates and the head",
            region,
            head.version,
            len(updates),
        )

    def give_snapshot(self, region: str, now: float) -> None:
        """A snapshot of the present to a region whose copy of the global weights cannot
        catch up from the updates it holds (it missed some that no one keeps any more):
        with :meth:`restore`, the only snapshot that crosses the WAN, once per
        :data:`GIVE_SNAPSHOT_SECONDS` at most."""
        if now - self._given.get(region, float("-inf")) < GIVE_SNAPSHOT_SECONDS:
            return
        self._given[region] = now
        head = self.head()
        try:
            self.buckets[region].write_snapshot(head.version, self.snapshot())
        except StorageError as error:
            log.warning("could not give region %s a snapshot (tried again later): %s", region, error)
            return
        log.warning(
            "region %s cannot catch up from the updates it holds: gave it a snapshot of version %d",
            region,
            head.version,
        )

    def _kept_update(self, version: Version, fragment: FragmentIndex) -> bytes | None:
        """The update of ``fragment`` published as ``version``, while the home keeps it (the
        head lists it, or it is in the fragment's window, which a reducer anchors with)."""
        try:
            good = self.home.read_update(version)
        except FileNotFoundError:
            return None
        return good if read_header(good, self.secret).meta.get("fragment") == fragment else None

    def repair(self, region: str, note: RefusalNote, learner: str) -> None:
        """Check a published object a learner of ``region`` refused (its head or an
        update); rewrite it if it is damaged or missing.  Snapshots are the region's
        reducer's to write again."""
        if (learner, note.key, note.time) in self._handled or region in self.behind:
            return
        self._handled.add((learner, note.key, note.time))
        bucket, head = self.buckets[region], self.head()
        layout = bucket.layout  # a syncer shard checks what it published, and leaves the others' alone
        try:
            if note.key == layout.head_key:
                if _refused(lambda: bucket.read_head()):
                    bucket.write_head(head)
                    self._repaired(region, note.key)
            elif match := layout.update_pattern.match(note.key):
                version, fragment = Version(int(match["version"])), FragmentIndex(int(match["fragment"]))
                good = self._kept_update(version, fragment)
                if good is None:
                    return  # no longer kept: nothing reads it or anchors with it
                if _read_or_none(lambda: bucket.read_update(version, fragment)) != good:
                    bucket.publish_update(version, fragment, good, replace=True)
                    self._repaired(region, note.key)
            # a snapshot: the region's reducer writes its snapshots, and writes them again
        except (StorageError, FileNotFoundError) as error:
            log.warning("could not check %s in region %s: %s", note.key, region, error)

    def _repaired(self, region: str, key: str) -> None:
        self.repairs += 1
        log.warning("rewrote %s in region %s: a learner refused it and it was damaged or missing", key, region)


def _read_or_none(read: Callable[[], bytes]) -> bytes | None:
    try:
        return read()
    except FileNotFoundError:
        return None


def _refused(read: Callable[[], object]) -> bool:
    try:
        read()
    except PayloadError:
        return True
    return False
