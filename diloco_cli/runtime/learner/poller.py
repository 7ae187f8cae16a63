"""Looking for newer global weights in the learner's region, and taking them into its bases.

A look (:meth:`GlobalPoller.look`) reads the head and the syncer's note to this learner,
then fetches and verifies whatever brings the learner's bases up to the head
(:class:`~diloco_cli.runtime.global_weights.GlobalReader`).  It runs on the poller's own
thread and touches none of the learner's state: its arguments are copies made by the
training thread.  The training thread takes a finished look (:meth:`take`), applies it to
the bases (:meth:`apply`) and only then starts the next one (:meth:`start_if_due`), from
the bases as they now are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.global_weights import Fetched, GlobalReader, Refusal, apply_fetch
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.store.documents import ControlNote
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import HEAD_KEY, RegionBucket

log = logging.getLogger("diloco.learner")


@dataclass
class Poll:
    """What one look at the region's global objects found."""

    fetched: Fetched | None = None
    resync_serial: int | None = None
    """The syncer's resync request this look answers, if any."""
    control: ControlNote | None = None
    """The syncer's note to this learner, as this look read it."""
    refusals: list[Refusal] = field(default_factory=list)


class GlobalPoller:
    """The learner's looks for newer global weights: one at a time, every ``poll_seconds``."""

    def __init__(self, bucket: RegionBucket, reader: GlobalReader, learner: LearnerId, poll_seconds: float) -> None:
        self.bucket, self.reader, self.learner = bucket, reader, learner
        self.poll_seconds = poll_seconds
        self.newest_head = Version(-1)
        """The newest head installed from: an older one is a replay."""
        self.resync_seen = 0
        """The last resync request of the syncer this learner answered."""
        self.needs_snapshot: set[FragmentIndex] = set()
        """Fragments whose updates could not be installed: fetched whole next time."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="poll")
        self._look: Future[Poll] | None = None
        self._last_look = float("-inf")

    def _bases(self, base_versions: Mapping[FragmentIndex, Version]) -> dict[FragmentIndex, Version]:
        return {p: Version(-1) if p in self.needs_snapshot else v for p, v in base_versions.items()}

    def start_if_due(self, base_versions: Mapping[FragmentIndex, Version]) -> None:
        """Start a look from these bases (every install so far applied) unless one is in
        flight or the last one started less than ``poll_seconds`` ago."""
        now = time.monotonic()
        if self._look is None and now - self._last_look >= self.poll_seconds:
            self._look = self._thread.submit(self.look, self._bases(base_versions), self.newest_head, self.resync_seen)
            self._last_look = now

    def take(self) -> Poll | None:
        """The look that finished since the last call, if one did."""
        if self._look is None or not self._look.done():
            return None
        future, self._look = self._look, None
        try:
            return future.result()
        except StorageError as error:
            log.warning("looking for global weights failed: %s", error)
            return None

    def look_now(self, base_versions: Mapping[FragmentIndex, Version]) -> Poll:
        """A look on the calling thread (at the start, and for tests), from these bases."""
        return self.look(self._bases(base_versions), self.newest_head, self.resync_seen)

    def look(self, bases: dict[FragmentIndex, Version], newest_head: Version, resync_seen: int) -> Poll:
        """Read the head and the syncer's note; fetch and verify whatever brings ``bases``
        up to the head (everything, when the note asks for a resync)."""
        poll = Poll()
        try:
            head = self.reader.head()
        except PayloadError as error:
            poll.refusals.append(Refusal("head", HEAD_KEY, str(error)))
            return poll
        if head is None:
            return poll
        if head.version < newest_head:
            reason = f"version {head.version} is older than version {newest_head} seen before: a replayed head"
            poll.refusals.append(Refusal("head", HEAD_KEY, reason))
            return poll
        try:
            poll.control = self.bucket.read_control(self.learner)
        except PayloadError as error:
            poll.refusals.append(Refusal("control", f"control/{self.learner}.json", str(error)))
        if poll.control is not None and poll.control.resync_serial > resync_seen:
            poll.resync_serial = poll.control.resync_serial
            due = {p: Version(-1) for p in head.fragment_versions}
        else:
            due = {p: base for p, base in bases.items() if head.fragment_versions.get(p, Version(0)) > base}
        poll.fetched = self.reader.fetch(head, due)
        poll.refusals += poll.fetched.refusals
        return poll

    def apply(
        self,
        poll: Poll,
        fragments: LearnerFragments,
        secret: RunSecret,
        refused: Callable[[str, str, str], None],
    ) -> dict[FragmentIndex, bool]:
        """On the training thread: apply what a look fetched to the bases, check each
        fragment against the head and make it the base.  Returns the fragments whose base
        changed, each with whether its unsent work is kept (a resync never keeps it)."""
        if poll.fetched is None:
            return {}
        installed: dict[FragmentIndex, bool] = {}
        keep_unsent = False if poll.resync_serial is not None else None
        for fetch in poll.fetched.fragments:
            try:
                values = apply_fetch(fetch, fragments.names(fetch.fragment), fragments.base, secret)
            except PayloadError as error:
                refused("install", f"fragment {fetch.fragment} version {fetch.version}", str(error))
                self.needs_snapshot.add(fetch.fragment)
                continue
            installed[fetch.fragment] = fragments.install(fetch.fragment, fetch.version, values, keep_unsent)
            self.needs_snapshot.discard(fetch.fragment)
            log.info("installed fragment %d at version %d (checked against the head)", fetch.fragment, fetch.version)
        self.newest_head = max(self.newest_head, poll.fetched.head.version)
        if poll.resync_serial is not None and len(installed) == len(poll.fetched.fragments):
            self.resync_seen = poll.resync_serial
        return installed

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
