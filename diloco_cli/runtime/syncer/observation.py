"""What the syncer sees of every region's bucket, turned into the decisions' observations.

Each turn the syncer scans every region at once (:func:`~.region_scan.scan_region` on
:class:`~.fanout.FanOut`): new payloads (verified markers, bytes read ahead so that over a
WAN the download overlaps the wait for a quorum) and, when asked, the learners'
heartbeats.  :class:`Observer` takes the findings in on the syncer's thread and keeps
what they imply until the payloads are consumed: the markers of arrivals not merged yet,
their bytes, the payloads consumed unmerged since the last commit (*retiring*: the next
commit's record lists them), every learner's newest heartbeat, what was refused, and
which regions can be reached (:mod:`.reachability`).  It decides nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from diloco_cli.codec import PayloadError
from diloco_cli.core import decisions
from diloco_cli.core.heartbeats import Heartbeats
from diloco_cli.core.ledger import PayloadId
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.runtime.coordinator import RefusalCount, take_in_heartbeat
from diloco_cli.runtime.syncer.context import SyncerContext
from diloco_cli.runtime.syncer.reachability import Reachability
from diloco_cli.runtime.syncer.region_scan import RegionScan, payload_id, qualified, scan_region
from diloco_cli.store.aggregates import AggregateRecord
from diloco_cli.store.documents import Heartbeat, ReducerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import UnanchoredSend
from diloco_cli.store.region import RELAY_KEY, PayloadRecord, RegionBucket
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.syncer")


@dataclass
class Look:
    """One turn's look at every region."""

    observations: list[decisions.Observation] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Regions that could not be reached this turn (they miss what is published)."""
    regained: list[str] = field(default_factory=list)
    """Regions reached again after an outage (to be caught up)."""
    wiped: list[str] = field(default_factory=list)
    """Regions that lost what the syncer published (their bucket wiped): to be given it back."""


class Observer:
    """The syncer's knowledge of the regions' buckets between two commits."""

    def __init__(
        self, context: SyncerContext, probes: dict[str, RegionBucket], consumed: Callable[[PayloadId], bool]
    ) -> None:
        self.buckets, self.probes, self.fanout = context.buckets, probes, context.fanout
        """Each region's bucket, and the same with a single try per call (a probe)."""
        self.consumed, self.clock = consumed, context.clock
        self.owns: Callable[[FragmentIndex], bool] = context.shard.owns
        """Whether a fragment is this syncer's (a syncer shard takes only its own)."""
        self.reducer_status: dict[str, ReducerStatus] = {}
        """Each region's reducer's status, as last read."""
        self.observed: dict[str, PayloadRecord] = {}
        """Markers of payloads seen and not consumed yet, by qualified key."""
        self.prefetched: dict[str, bytes] = {}
        """Bytes of observed payloads, read as soon as their marker was seen."""
        self.retiring: dict[str, PayloadId] = {}
        """Payloads consumed unmerged since the last commit (its record will list them)."""
        self.unanchored: dict[str, UnanchoredSend] = {}
        """Those of them refused because their base could not be anchored, with the tokens they held."""
        self.heard: Heartbeats[Heartbeat] = Heartbeats()
        """Every learner's newest heartbeat; replayed older ones are refused."""
        self.refusal_counts = {name: RefusalCount(log, where=f" in region {name}") for name in self.buckets}
        """What was refused in each region (every time it is met)."""
        self.refusals = {name: count.refusals for name, count in self.refusal_counts.items()}
        self.reachability = Reachability()
        self.whole: dict[str, bool] = dict.fromkeys(self.buckets, False)
        """Whether the region's last scan saw all of it (no listing or read failed):
        only then can the syncer know that nothing of the region waits to be merged."""

    # ------------------------------------------------------------------- looking

    def look(self, spec: RunSpec, read_heartbeats: bool, published: Sequence[str] = ()) -> Look:
        """Scan every reachable region (and those due for a probe), all at once; take in
        what each scan found, region by region.  With the heartbeats, each region is
        checked for the ``published`` keys (what the syncer's last publication left)."""
        look = Look()
        now = self.clock()
        regions = [
            name for name in self.buckets if not self.is_down(name) or self.reachability.due_for_probe(name, now)
        ]

        def scan(region: str) -> RegionScan:
            learners = [learner.id for learner in spec.learners if learner.region == region] if read_heartbeats else []
            bucket = self.probes[region] if self.is_down(region) else self.buckets[region]
            return scan_region(
                bucket,
                learners,
                known=lambda name: name in self.observed or name in self.retiring,
                consumed=lambda name: self.consumed(payload_id(name)),
                owns=self.owns,
                published=published,
            )

        for found in self.fanout.each(scan, regions):
            self.whole[found.region] = found.whole
            if found.unreachable is not None:
                self._lost(found, look)
                continue
            since = self.reachability.reached(found.region)
            if since is not None:
                log.info(
                    "region %s is reachable again after %.0f s; catching it up", found.region, self.clock() - since
                )
                look.regained.append(found.region)
            if found.published_missing:
                look.wiped.append(found.region)
            look.observations += self._arrivals(found)
            look.observations += self._heartbeats_seen(found)
            if isinstance(found.reducer, PayloadError):
                key = self.buckets[found.region].layout.reducer_status_key
                self.refused(found.region, "status", key, found.reducer)
            elif found.reducer is not None:
                self.reducer_status[found.region] = found.reducer
                self._retire_refused_by_reducer(found.region, found.reducer)
        return look

    def _lost(self, scan: RegionScan, look: Look) -> None:
        """A region that cannot be reached is skipped until a probe reaches it."""
        if not self.is_down(scan.region):
            log.warning(
                "region %s is unreachable: skipping it until a probe reaches it (%s)", scan.region, scan.unreachable
            )
        self.reachability.failed(scan.region, scan.unreachable, self.clock())
        look.lost.append(scan.region)

    def _arrivals(self, scan: RegionScan) -> list[decisions.Observation]:
        for key, error in scan.refused:
            self.refused(scan.region, "marker", key, error)
            self.retire(payload_id(qualified(scan.region, key)))
        found: list[decisions.Observation] = []
        for record in scan.records:
            name = qualified(scan.region, record.key)
            if isinstance(record, AggregateRecord):
                found += self._aggregate(scan.region, name, record)
                if not record.sends:
                    continue
            self.observed[name] = record
            if record.key in scan.payloads:
                self.prefetched[name] = scan.payloads[record.key]
            if isinstance(record, PayloadRecord):
                arrival = decisions.Arrival(
                    record.learner,
                    record.fragment,
                    record.base_version,
                    record.c_steps,
                    record.c_tokens,
                    record.sequence,
                    name,
                )
                found.append(decisions.ArrivalSeen(arrival))
        return found

    def _aggregate(self, region: str, name: str, record: AggregateRecord) -> list[decisions.Observation]:
        """A region's aggregate: each send it holds arrives (in the aggregate, at its
        anchor), each send it could not anchor asks for a resync.  One that holds no
        send is consumed at once (the next commit lists it)."""

        def arrival(send, group: str | None) -> decisions.Arrival:
            key = qualified(region, send.key)
            return decisions.Arrival(
                send.learner,
                record.fragment,
                send.base_version,
                send.c_steps,
                send.c_tokens,
                send.sequence,
                key,
                group=group,
                anchor=record.anchor if group else None,
            )

        found: list[decisions.Observation] = [decisions.ArrivalSeen(arrival(send, name)) for send in record.sends]
        found += [decisions.ResyncRequested(arrival(send, None)) for send in record.resync]
        if not record.sends:
            self.retire(payload_id(name))
        return found

    def _retire_refused_by_reducer(self, region: str, status: ReducerStatus) -> None:
        """Payloads the region's reducer refused and removed: retired (the next commit
        lists them), as the payloads this syncer refuses itself are."""
        for key in status.refused_payloads:
            payload = payload_id(qualified(region, key))
            if payload is not None and payload.key not in self.retiring and not self.consumed(payload):
                self.retire(payload)

    def _heartbeats_seen(self, scan: RegionScan) -> list[decisions.Observation]:
        found: list[decisions.Observation] = []
        for learner, beat in scan.heartbeats:
            heard = take_in_heartbeat(self.heard, learner, beat, self.refusal_counts[scan.region].refused)
            if heard is not None and heard.news:
                newest = self.heartbeats[learner]
                found.append(decisions.HeartbeatSeen(learner, newest.step_seconds, newest.state.value))
        return found

    # ---------------------------------------------------------------- what it holds

    @property
    def heartbeats(self) -> dict[LearnerId, Heartbeat]:
        """Every learner's newest heartbeat taken in."""
        return self.heard.newest

    def is_down(self, region: str) -> bool:
        return self.reachability.is_down(region)

    def reachable(self) -> list[str]:
        return [name for name in self.buckets if not self.is_down(name)]

    @property
    def idle(self) -> bool:
        """Nothing observed waits to be merged."""
        return not self.observed

    def refused(self, region: str, kind: str, key: str, error: Exception) -> None:
        self.refusal_counts[region].refused(kind, key, error)

    def retire(self, payload: PayloadId | None) -> None:
        """A payload consumed without a merge: the next commit's record lists it, and it
        is deleted once that record is durable."""
        if payload is None:
            return
        self.retiring[payload.key] = payload
        self.forget([payload.key])
        if RELAY_KEY.match(payload.key.split(":", 1)[1]):
            # deleted at once: its reducer then lets the send go (and holds nothing for
            # it), whether or not a later commit lists it; nothing is merged from a relay gone
            self.delete([payload.key])

    def refuse_unanchored(self, arrival: decisions.Arrival) -> None:
        """A send whose base cannot be anchored (older than the window, or newer than this
        syncer's version; its learner is told to resync): retired, and the
        next commit's record counts the tokens it held as refused."""
        self.retire(payload_id(arrival.key))
        self.unanchored[arrival.key] = UnanchoredSend(
            key=arrival.key,
            learner=arrival.learner,
            fragment=arrival.fragment,
            sequence=arrival.sequence,
            base_version=arrival.base_version,
            c_tokens=arrival.c_tokens,
        )

    def forget(self, names: list[str]) -> None:
        """Payloads consumed (merged, or retired and committed)."""
        for name in names:
            self.observed.pop(name, None)
            self.prefetched.pop(name, None)

    def take_retiring(self) -> dict[str, PayloadId]:
        """The payloads retired since the last commit, for the commit that lists them."""
        retiring, self.retiring = self.retiring, {}
        self.unanchored = {}
        return retiring

    def bucket_and_key(self, name: str) -> tuple[RegionBucket, str]:
        region, key = name.split(":", 1)
        return self.buckets[region], key

    def payloads(self, names: list[str]) -> dict[str, bytes | None] | StorageError:
        """The bytes of these arrivals (None for one that vanished), read ahead or now,
        every region at once; the error when a bucket cannot be read now (the merge
        waits rather than drop an arrival)."""

        def read(name: str) -> bytes | StorageError | None:
            bucket, key = self.bucket_and_key(name)
            try:
                return bucket.read_payload(key)
            except FileNotFoundError:
                return None
            except StorageError as error:
                return error

        missing = [name for name in names if name not in self.prefetched]
        blobs = dict(zip(missing, self.fanout.each(read, missing)))
        blobs.update({name: self.prefetched[name] for name in names if name in self.prefetched})
        failed = [blob for blob in blobs.values() if isinstance(blob, StorageError)]
        return failed[0] if failed else blobs

    def delete(self, names: list[str]) -> None:
        """Delete consumed payloads (the ledger says they are consumed: one whose delete
        fails is deleted when a later scan sees it again)."""

        def delete(name: str) -> None:
            bucket, key = self.bucket_and_key(name)
            try:
                bucket.delete_payload(key)
            except StorageError as error:
                log.warning("could not delete %s: %s", name, error)

        self.fanout.each(delete, names)
