"""Looking for newer global weights in the learner's region, and taking them into its bases.

A look (:meth:`GlobalPoller.look`) reads the head and the syncer's note to this learner,
then fetches and verifies whatever brings the learner's bases up to the head
(:class:`~diloco_cli.runtime.global_weights.GlobalReader`); with syncer shards, each
shard's head and note, and each fragment from its own shard.  It runs on the poller's
own thread and touches none of the learner's state: its arguments are copies made by the
training thread.  The training thread takes a finished look (:meth:`take`), applies it to
the bases (:meth:`apply`) and only then starts the next one (:meth:`start_if_due`), from
the bases as they now are.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.global_weights import Fetched, GlobalReader, Refusal, apply_fetch
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.store.documents import ControlNote
from diloco_cli.store.filesystem import StorageError

log = logging.getLogger("diloco.learner")


@dataclass
class Poll:
    """What one look at the region's global objects found."""

    fetched: list[Fetched] = field(default_factory=list)
    """What each syncer shard's head brings (those whose head could be read)."""
    resync_serials: dict[int, int] = field(default_factory=dict)
    """Per syncer shard, its resync request this look answers."""
    control: ControlNote | None = None
    """The syncer's note to this learner, as this look read it (shard 0's, with
    syncer shards: it speaks for the run's membership)."""
    refusals: list[Refusal] = field(default_factory=list)


AWAITING_WINDOW_SECONDS = 10.0
"""The shortest time after a send the learner looks often for its merge."""
OVERDUE_ROUND_TRIPS = 3
"""A send still unmerged after this many of the learner's usual round trips (the median
of its recent ones) is late: a syncer down, a quorum waiting for a slow learner.  Looking
often then buys no fresher weights, only requests; the learner goes back to
``poll_seconds`` until the merge comes."""


class GlobalPoller:
    """The learner's looks for newer global weights: one at a time, every ``poll_seconds``,
    or every ``awaiting_seconds`` while a send of the learner awaits its merge and is not
    late (where it is the shorter).  ``readers``: one per syncer shard, in shard order (one
    with a single syncer)."""

    def __init__(
        self, readers: Sequence[GlobalReader], learner: LearnerId, poll_seconds: float, awaiting_seconds: float
    ) -> None:
        self.readers, self.learner = list(readers), learner
        self.poll_seconds, self.awaiting_seconds = poll_seconds, awaiting_seconds
        self.newest_head = {reader.shard.index: Version(-1) for reader in self.readers}
        """Per syncer shard, the newest head installed from: an older one is a replay."""
        self.resync_seen = {reader.shard.index: 0 for reader in self.readers}
        """Per syncer shard, the last resync request this learner answered."""
        self.needs_snapshot: set[FragmentIndex] = set()
        """Fragments whose updates could not be installed: fetched whole next time."""
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="poll")
        self._look: Future[Poll] | None = None
        self._last_look = float("-inf")
        self._sent_at: dict[FragmentIndex, float] = {}
        """When each fragment awaiting its merge was first seen sent (since its last install)."""
        self._round_trips: deque[float] = deque(maxlen=9)
        """The latest sends' times from the send to the install."""

    @property
    def initial(self) -> Mapping[str, torch.Tensor] | None:
        """The learner's own version 0, while it may start from it (see :class:`GlobalReader`)."""
        return self.readers[0].initial

    @initial.setter
    def initial(self, initial: Mapping[str, torch.Tensor] | None) -> None:
        for reader in self.readers:
            reader.initial = initial

    def _bases(self, base_versions: Mapping[FragmentIndex, Version]) -> dict[FragmentIndex, Version]:
        return {p: Version(-1) if p in self.needs_snapshot else v for p, v in base_versions.items()}

    def start_if_due(
        self, base_versions: Mapping[FragmentIndex, Version], awaiting: Collection[FragmentIndex] = ()
    ) -> None:
        """Start a look from these bases (every install so far applied) unless one is in
        flight or the last one started less than the interval ago: ``poll_seconds``, or
        while a send of a fragment in ``awaiting`` waits for its merge, and is not late
        (:meth:`awaiting_window`), the shorter of it and ``awaiting_seconds``."""
        now = time.monotonic()
        for fragment in awaiting:
            self._sent_at.setdefault(fragment, now)
        for fragment in [f for f in self._sent_at if f not in awaiting]:  # installed since
            self._round_trips.append(now - self._sent_at.pop(fragment))
        expected = any(now - sent < self.awaiting_window() for sent in self._sent_at.values())
        interval = min(self.poll_seconds, self.awaiting_seconds) if expected else self.poll_seconds
        if self._look is None and now - self._last_look >= interval:
            self._look = self._thread.submit(
                self.look, self._bases(base_versions), dict(self.newest_head), dict(self.resync_seen)
            )
            self._last_look = now

    def awaiting_window(self) -> float:
        """How long after a send the learner looks often for its merge: ``OVERDUE_ROUND_TRIPS``
        of its usual round trips, at least ``AWAITING_WINDOW_SECONDS``."""
        usual = statistics.median(self._round_trips) if self._round_trips else 0.0
        return max(AWAITING_WINDOW_SECONDS, OVERDUE_ROUND_TRIPS * usual)

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
        return self.look(self._bases(base_versions), dict(self.newest_head), dict(self.resync_seen))

    def look(
        self, bases: dict[FragmentIndex, Version], newest_head: dict[int, Version], resync_seen: dict[int, int]
    ) -> Poll:
        """Read each syncer shard's head and note; fetch and verify whatever brings
        ``bases`` up to the heads (whole, from the snapshot, when a shard's note asks for
        a resync)."""
        poll = Poll()
        for reader in self.readers:
            shard = reader.shard.index
            self._look_at(
                reader,
                {p: v for p, v in bases.items() if reader.shard.owns(p)},
                newest_head[shard],
                resync_seen[shard],
                poll,
            )
        return poll

    def _look_at(
        self,
        reader: GlobalReader,
        bases: dict[FragmentIndex, Version],
        newest_head: Version,
        resync_seen: int,
        poll: Poll,
    ) -> None:
        """One syncer shard's part of a look, added to ``poll``."""
        head_key = reader.bucket.layout.head_key
        try:
            head = reader.head()
        except PayloadError as error:
            poll.refusals.append(Refusal("head", head_key, str(error)))
            return
        if head is None:
            return
        if head.version < newest_head:
            reason = f"version {head.version} is older than version {newest_head} seen before: a replayed head"
            poll.refusals.append(Refusal("head", head_key, reason))
            return
        control = None
        try:
            control = reader.bucket.read_control(self.learner)
        except PayloadError as error:
            poll.refusals.append(Refusal("control", reader.bucket.layout.control_key(self.learner), str(error)))
        if reader.shard.index == 0:
            poll.control = control
        due = {p: base for p, base in bases.items() if head.fragment_versions.get(p, Version(0)) > base}
        if control is not None and control.resync_serial > resync_seen:
            # every fragment behind the head, whole from the snapshot; one at the head's
            # version already holds the newest global, and keeps the work trained on it (a
            # reinstall of the same version would drop its unsent work, and a send from
            # it would then supersede one in flight from that version, losing that work)
            poll.resync_serials[reader.shard.index] = control.resync_serial
            due = {p: Version(-1) for p in due}
        fetched = reader.fetch(head, due)
        poll.fetched.append(fetched)
        poll.refusals += fetched.refusals

    def apply(
        self,
        poll: Poll,
        fragments: LearnerFragments,
        secret: RunSecret,
        refused: Callable[[str, str, str], None],
    ) -> dict[FragmentIndex, bool]:
        """On the training thread: apply what a look fetched to the bases, check each
        fragment against its head and make it the base.  Returns the fragments whose base
        changed, each with whether its unsent work is kept (a resync never keeps it)."""
        installed: dict[FragmentIndex, bool] = {}
        for fetched in poll.fetched:
            resync = poll.resync_serials.get(fetched.shard)
            keep_unsent = False if resync is not None else None
            done = 0
            for fetch in fetched.fragments:
                try:
                    values = apply_fetch(fetch, fragments.names(fetch.fragment), fragments.base, secret)
                except PayloadError as error:
                    refused("install", f"fragment {fetch.fragment} version {fetch.version}", str(error))
                    self.needs_snapshot.add(fetch.fragment)
                    continue
                installed[fetch.fragment] = fragments.install(fetch.fragment, fetch.version, values, keep_unsent)
                self.needs_snapshot.discard(fetch.fragment)
                done += 1
                lag = fragments.install_lag[fetch.fragment]
                log.info(
                    "installed fragment %d at version %d%s (checked against the head)",
                    fetch.fragment,
                    fetch.version,
                    "" if lag is None else f", {lag} steps after its send",
                )
            self.newest_head[fetched.shard] = max(self.newest_head[fetched.shard], fetched.head.version)
            if resync is not None and done == len(fetched.fragments):
                self.resync_seen[fetched.shard] = resync
        return installed

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
