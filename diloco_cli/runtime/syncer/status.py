"""The syncer's status document (``global/syncer.json`` in every region), as ``diloco
status`` shows it: versions, merges, the quorum and grace window now, why each fragment
waits, held-out losses, storage counts, refusals, repairs and outages.

Counts continue across the syncer's restarts: a started syncer takes its storage
counts, refusals, repairs and leftovers removed from its newest status in any region
(:meth:`StatusBoard.continue_counts`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from diloco_cli.codec import PayloadError
from diloco_cli.core import decisions
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.runtime.syncer.context import SyncerContext
from diloco_cli.runtime.syncer.leftovers import LeftoverSweeper
from diloco_cli.runtime.syncer.observation import Observer
from diloco_cli.runtime.syncer.publication import Publication
from diloco_cli.runtime.syncer.state import SyncerState
from diloco_cli.store.documents import HeartbeatHeard, LastMerge, Refusals, SyncerPhase, SyncerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import SyncerHome
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.region import RegionBucket
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.syncer")


class StatusBoard:
    """What the syncer reports about itself, and where it writes it."""

    def __init__(
        self,
        context: SyncerContext,
        state: SyncerState,
        observer: Observer,
        publication: Publication,
        sweepers: dict[str, LeftoverSweeper],
        parameters: int,
    ) -> None:
        self.buckets: dict[str, RegionBucket] = context.buckets
        self.home: SyncerHome = context.home
        self.fanout = context.fanout
        self.state, self.observer, self.publication, self.sweepers = state, observer, publication, sweepers
        self.parameters = parameters
        self.place = context.place.place
        """Where this syncer (shard) runs, for bandwidth reports."""
        self.started_at = time.time()
        self.merge_times: deque[float] = deque(maxlen=50)
        self.last_merge: LastMerge | None = None
        self.reasons: dict[FragmentIndex, str] = {}
        """Per fragment, what the decisions last said about it."""
        self.storage_before: dict[str, StorageCounters] = {}
        self.home_storage_before = StorageCounters()
        self.refusals_before: dict[str, Refusals] = {}
        self.repairs_before = 0
        self.leftovers_before = 0

    def continue_counts(self) -> None:
        """Storage counts, refusals, repairs and leftovers removed of the syncer's earlier
        starts, from its newest status in any region, so that a restart continues them;
        and the heartbeats they took in, so that it refuses older ones (replays)."""
        newest: SyncerStatus | None = None
        for name, bucket in self.buckets.items():
            try:
                status = bucket.read_syncer_status()
            except (StorageError, PayloadError) as error:
                log.warning(
                    "the syncer's last status in region %s cannot be read (%s); its counts start again", name, error
                )
                continue
            if status is not None and (newest is None or status.time > newest.time):
                newest = status
        if newest is not None:
            self.storage_before, self.home_storage_before = dict(newest.storage), newest.home_storage
            self.refusals_before = dict(newest.refusals)
            self.repairs_before, self.leftovers_before = newest.repairs, newest.leftovers_removed
            self.observer.heard.earlier = dict(newest.heartbeats)

    def merged(self, merge: LastMerge) -> None:
        self.merge_times.append(merge.time)
        self.last_merge = merge

    def status(
        self,
        phase: SyncerPhase,
        now: float,
        spec: RunSpec,
        decided: decisions.DecisionState,
        given_up: dict[LearnerId, str],
        ending: str | None = None,
    ) -> SyncerStatus:
        recent = [t for t in self.merge_times if t > time.time() - 60]
        state, reachability = self.state, self.observer.reachability
        return SyncerStatus(
            state=phase,
            run=spec.run,
            version=state.version,
            fragment_versions=dict(state.fragment_versions),
            snapshot_version=state.snapshot_version,
            merges=state.merges,
            merges_per_minute=len(recent),
            last_merge=self.last_merge,
            quorum=decided.policy.quorum,
            effective_quorum=decided.effective_quorum(now),
            grace_seconds=decided.grace_seconds(now),
            live_learners=sorted(decided.live_learners(now)),
            pending={p: sorted(r.pending) for p, r in decided.rounds.items() if r.pending},
            reasons=dict(sorted(self.reasons.items())),
            evaluations=state.evaluations,
            parameters=self.parameters,
            place=self.place,
            storage={
                name: self.storage_before.get(name, StorageCounters()).plus(bucket.store.meter.snapshot())
                for name, bucket in self.buckets.items()
            },
            home_storage=self.home_storage_before.plus(self.home.store.meter.snapshot()),
            refusals={
                name: self.refusals_before.get(name, Refusals()).plus(refusals)
                for name, refusals in self.observer.refusals.items()
            },
            repairs=self.repairs_before + self.publication.repairs,
            leftovers_removed=self.leftovers_before + sum(sweeper.removed for sweeper in self.sweepers.values()),
            unreachable={name: outage.reason for name, outage in reachability.down.items()},
            outages=reachability.outages_seen,
            given_up=given_up,
            heartbeats=HeartbeatHeard.of(self.observer.heartbeats),
            ending=ending,
            started_at=self.started_at,
            time=time.time(),
        )

    def write(self, status: SyncerStatus) -> None:
        """The status to every region that can be reached now, all at once."""

        def write(name: str) -> None:
            try:
                self.buckets[name].write_syncer_status(status)
            except StorageError as error:
                log.warning("could not write the status to region %s: %s", name, error)

        self.fanout.each(write, self.observer.reachable())
