"""A region's reducer: its learners' sends become one aggregate per fragment before the WAN.

One supervised process per region, beside the region's bucket.  Each turn reads top to
bottom:

1. **follow the global weights**: every few seconds read the learners' heartbeats (who
   may still send, which of the region's snapshots they found damaged); read the head;
   add the updates the region's copy lacks (:mod:`.replica`), writing the region's
   snapshot when the copy reaches the head's snapshot version, and removing updates and
   snapshots no reader needs any more;
2. **resolve**: an aggregate whose fragment moved on was merged (the head's ``merged``
   marks cover its sends: its payloads are deleted) or discarded (its sends wait again,
   its error feedback goes back); payloads the syncer merged are deleted;
3. **look**: new payloads of the region's learners (markers verified);
4. **forward**: for each fragment, the sends the forwarding decides on (:mod:`.forwarding`)
   are anchored, merged into a partial merge, quantized with error feedback and written
   as one aggregate (:mod:`.aggregation`); the syncer reads it across the WAN;
5. **report**: the reducer's status in the region's bucket.

Killed at any instant, a reducer restarts from the region's bucket alone: its copy from
its newest snapshot (or version 0) and the updates after it, its aggregates in flight
from their markers, its error feedback from ``reducer/residuals/``.  The syncer's ledger
keeps every send merged at most once whatever a reducer forwards.

With syncer shards the region's reducer process reduces for each shard on its own
(:func:`run_reducers`): a :class:`Reducer` per shard, over that shard's fragments and
the bucket as that shard lays it out, is the region's reducer of that shard.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret
from diloco_cli.codec.parallel import resolve_threads
from diloco_cli.core.cadence import END_READ_SECONDS, Cadences, due_to_finish
from diloco_cli.core.decisions import GONE_STATES
from diloco_cli.core.fragments import SyncerShard, fragments_of_model
from diloco_cli.core.heartbeats import Heartbeats
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.runtime.outer_gradients import check_announced
from diloco_cli.runtime.reducer.aggregation import Aggregation, send_of
from diloco_cli.runtime.reducer.forwarding import ForwardPolicy, Waiting, to_forward, to_relay
from diloco_cli.runtime.reducer.replica import DamagedWindowUpdate, GlobalReplica, ReplicaGap
from diloco_cli.runtime.workspace import MergeWorkspace
from diloco_cli.store import aggregates as store
from diloco_cli.store.aggregates import AGGREGATE_KEY, AggregateRecord, reducer_of
from diloco_cli.store.documents import Head, Heartbeat, HeartbeatHeard, ReducerStatus, Refusals
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.region import (
    PAYLOAD_KEY,
    RELAY_KEY,
    SEQUENCE_PER_EPOCH,
    PayloadRecord,
    heartbeat_key,
    relayed_payload_key,
)
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.reducer")

EXIT_FINISHED = 0
EXIT_STOPPED = 143
GAP_SECONDS = 10.0
"""How long the region's copy waits for a missing update before it asks for a snapshot."""
REPEAT_SECONDS = 10.0
"""The same refusal (object and reason) is logged and reported again at most this often:
a damaged update is met every turn until the syncer rewrites it."""


class Reducer:
    """The reducer of one region (for one syncer shard's fragments, in a run of several):
    :meth:`start`, then :meth:`turn` until the run ends."""

    def __init__(
        self,
        spec: RunSpec,
        region: str,
        secret: RunSecret,
        clock=time.monotonic,
        manifest: ManifestWatch | None = None,
        syncer_shard: int = 0,
    ) -> None:
        self.spec, self.region, self.secret, self.clock = spec, region, secret, clock
        self.manifest = manifest
        """The run's manifest, followed for learners added or drained (``diloco scale``)."""
        self.recipe = spec.recipe
        self.shard: SyncerShard = spec.syncer_shard(syncer_shard)
        self.bucket = spec.bucket(region, secret).for_syncer_shard(self.shard)
        self.finished = False
        self.replica: GlobalReplica | None = None
        self.initial_weights = "unchecked"
        self.waiting: dict[str, Waiting] = {}
        """Sends not forwarded yet, by payload key."""
        self.records: dict[str, PayloadRecord] = {}
        self.consumed: set[str] = set()
        """Payloads known merged or retired (kept when consumed payloads are kept)."""
        self.in_flight: dict[str, AggregateRecord] = {}
        """Aggregates forwarded and not resolved yet, by key."""
        self.relayed: dict[str, PayloadRecord] = {}
        """Sends relayed (under K < M) that the syncer has not let go yet, by relay key:
        it deletes a relay once it merged or retired it, and the payload then goes."""
        self.heartbeats: dict[LearnerId, tuple[float, str, float]] = {}
        """Per learner of the region: its heartbeat's time and state, and when it changed (reducer clock)."""
        self.heard: Heartbeats[Heartbeat] = Heartbeats()
        """Per learner of the region: its newest heartbeat (its progress: when it is due to
        finish); replayed older ones are refused."""
        self.report_soon = False
        """A learner stopped going on, or the reducer let go of the last thing it held, since
        the last status: write it at the next turn that can."""
        self.holding = False
        """Whether the reducer held sends (waiting, in an aggregate, relayed) after its last turn."""
        self.refusals = Refusals()
        self.refused_payloads: set[str] = set()
        """Payloads refused and removed, listed in the status until a merge of the same
        learner and fragment passes them (the syncer's ledger retires them)."""
        self._last_refused: dict[tuple[str, str, str], float] = {}
        """When each (kind, key, reason) was last reported."""
        self.counts = {"aggregates": 0, "sends": 0, "voided": 0}
        self.snapshot_version = Version(-1)
        self.damaged_snapshots: set[Version] = set()
        """Snapshot versions the region's learners reported refusing (damaged or missing)."""
        self.reported: set[tuple[LearnerId, str, float]] = set()
        """Learners' refusal notes already taken in (their heartbeats repeat them)."""
        self.gap_since: float | None = None
        """Since when the region's copy cannot add the next update (one is missing)."""
        self.started_at = time.time()
        self.cadences = Cadences("beats", "ending", "status")

    # ----------------------------------------------------------------------- start

    def start(self) -> None:
        """Build the model from the recipe's seed (version 0, checked once a head says
        what the syncer's is), count this start, and pick up what a killed reducer left."""
        self._started_clock = self.clock()
        torch.manual_seed(self.recipe.training.seed)
        model = self.recipe.model.build()
        self.fragments = fragments_of_model(model, self.recipe.sync.num_fragments)
        self.owned = self.shard.of(self.fragments)
        self.initial = {name: parameter.detach() for name, parameter in model.named_parameters()}
        epoch = self.bucket.read_epoch(self.bucket.layout.reducer_name) + 1
        self.bucket.write_epoch(self.bucket.layout.reducer_name, epoch)
        self.aggregation = Aggregation(
            self.bucket,
            self.secret,
            self.fragments,
            self.recipe.sync.learner_codec,
            epoch,
            MergeWorkspace(resolve_threads(self.recipe.sync.merge_threads)),
            self.owned,
        )
        self.storage_before = self._previous_counts()
        for key in filter(self._owns, store.aggregate_keys(self.bucket)):
            try:
                self.in_flight[key] = store.aggregate_record(self.bucket, key)
            except PayloadError as error:
                self._refused("aggregate", key, error)
                store.delete_aggregate(self.bucket, key)
            except FileNotFoundError:
                continue
        for key in filter(self._owns, self.bucket.relay_keys()):
            try:
                self.relayed[key] = self.bucket.payload_record(key)
            except (PayloadError, FileNotFoundError):
                continue  # the syncer refuses (and deletes) a relay whose marker is not authentic

    def _owns(self, key: str) -> bool:
        """Whether a payload, relay or aggregate key is of this reducer's fragments (with
        syncer shards, the region's reducer of each shard takes its own)."""
        match = PAYLOAD_KEY.match(key) or RELAY_KEY.match(key) or AGGREGATE_KEY.match(key)
        return match is not None and self.shard.owns(int(match["fragment"]))

    def _previous_counts(self) -> StorageCounters:
        try:
            status = store.read_reducer_status(self.bucket)
        except PayloadError:
            return StorageCounters()
        if status is None:
            return StorageCounters()
        self.counts = {"aggregates": status.aggregates, "sends": status.sends, "voided": status.voided}
        self.snapshot_version = status.snapshot_version
        self.refused_payloads = set(status.refused_payloads)
        self.refusals = status.refusals  # counted on from there, as the storage counts are
        self.heard.earlier = dict(status.heartbeats)  # older heartbeats read now are replays
        return status.storage

    def _policy(self) -> ForwardPolicy:
        sync, active = self.recipe.sync, self.spec.active_learners
        return ForwardPolicy(
            quorum=self.spec.recipe.quorum,
            num_learners=len(active),
            region_learners=sum(1 for learner in active if learner.region == self.region),
            window_seconds=sync.forward_window_seconds,
            longest_wait_seconds=sync.liveness_timeout_seconds,
        )

    # ------------------------------------------------------------------------ loop

    def run(self) -> int:
        return run_reducers([self])

    def turn(self, read_heartbeats: bool | None = None) -> float:
        """One turn: follow the global weights, resolve, look, forward, report; returns
        when to wake for the next."""
        now = self.clock()
        sync = self.recipe.sync
        wake = now + sync.poll_seconds
        if read_heartbeats is None:
            read_heartbeats = self.cadences.due("beats", now, self.recipe.training.heartbeat_seconds) or (
                due_to_finish(self.heard.newest.values(), time.time())
                and self.cadences.due("ending", now, END_READ_SECONDS)
            )
        if read_heartbeats:
            self._follow_manifest()
            self.report_soon |= self._read_heartbeats()
            self._check_own_objects()
        head = self._read_head()
        if head is None or not self._follow(head):
            return wake
        self._resolve(head)
        self._look(head, now)
        self._forward(now)
        holding = bool(self.waiting or self.in_flight or self.relayed)
        self.report_soon |= self.holding and not holding  # the end of the run waits for a status holding nothing
        self.holding = holding
        # a finished head is not the end while a learner of the region may still send: after
        # `diloco resume` brings one back, this reducer may read the head before the syncer rewrites it
        if head.finished and not self.waiting and not self.in_flight and not self.relayed and not self._live():
            self.finished = True
            self._write_status()
            log.info("finished: the run is over and nothing of this region waits")
        elif self.cadences.due("status", now, sync.status_seconds) or self.report_soon:
            self._write_status()  # and at once when a learner stopped going on: the syncer waits for it at the end
        return wake

    # --------------------------------------------------- following the global weights

    def _read_head(self) -> Head | None:
        try:
            return self.bucket.read_head()
        except PayloadError as error:
            self._refused("head", self.bucket.layout.head_key, error)
        except StorageError as error:
            log.warning("the head cannot be read now: %s", error)
        return None

    def _follow(self, head: Head) -> bool:
        """Bring the region's copy up to the head; False while it cannot be (no copy)."""
        if self.replica is None and not (self._number_after(head) and self._build_replica(head)):
            return False
        try:
            if head.version > self.replica.version:
                for version, fragment in self.replica.pending(head):
                    self._add(version, fragment)
                    self._snapshot_if_due(head)
            self.replica.check(head)
            self.gap_since = None
        except ReplicaGap as error:
            if self.gap_since is None:
                self.gap_since = self.clock()
                log.info("the region's copy waits at version %d: %s", self.replica.version, error)
            self._start_again_from_a_newer_snapshot()
        except (PayloadError, StorageError) as error:
            log.warning("the region's copy stays at version %d: %s", self.replica.version, error)
        self._snapshot_if_due(head)
        return True

    def _add(self, version: Version, fragment: FragmentIndex) -> None:
        """One update into the region's copy; a damaged one is reported (in the reducer's
        status: the syncer rewrites it from its commits) and stops the copy there."""
        try:
            self.replica.add(version, fragment)
        except PayloadError as error:
            self._refused("update", self.bucket.layout.update_key(version, fragment), error)
            raise

    @property
    def needs_snapshot(self) -> bool:
        """Whether the region's copy has waited for a missing update long enough that the
        syncer should give the region a snapshot (the region missed updates during an
        outage that are no longer kept anywhere)."""
        return self.gap_since is not None and self.clock() - self.gap_since >= GAP_SECONDS

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
                self._refused("snapshot", self.bucket.layout.snapshot_key(version), error)
                continue
            if all(newer.versions.get(p, -1) >= v for p, v in replica.versions.items()):
                log.info("the region's copy starts again from the snapshot of version %d", version)
                self.replica, self.gap_since = newer, None
                return

    def _number_after(self, head: Head) -> bool:
        """Number this start's aggregates above every one the syncer merged from the
        region (the head's marks): with the bucket wiped, the epoch record this start
        counted from is gone, and a serial used again would be taken for one consumed.
        False while the epoch record cannot be written."""
        marks = head.merged.get(reducer_of(self.region), {})
        merged_epoch = max(marks.values(), default=0) // SEQUENCE_PER_EPOCH
        if merged_epoch < self.aggregation.epoch:
            return True
        try:
            self.bucket.write_epoch(self.bucket.layout.reducer_name, merged_epoch + 1)
        except StorageError as error:
            log.warning("the reducer's epoch record cannot be written now: %s", error)
            return False
        log.warning(
            "the region's bucket lost this reducer's epoch record (was it wiped?): epoch %d, above the serials "
            "the syncer merged",
            merged_epoch + 1,
        )
        self.aggregation.epoch = merged_epoch + 1
        return True

    def _build_replica(self, head: Head) -> bool:
        """The region's copy: from the newest snapshot this region holds that verifies, else
        version 0 built here (refused when it is not the syncer's)."""
        sync = self.recipe.sync
        for version in sorted(self.bucket.snapshot_versions(), reverse=True):
            try:
                payload = self.bucket.read_snapshot(version)
                self.replica = GlobalReplica.from_snapshot(
                    self.fragments, payload, self.bucket, self.secret, sync.window_versions
                )
                self.initial_weights = "match"
                self._restore_errors(head)
                log.info("the region's copy starts from its snapshot of version %d", version)
                return True
            except (PayloadError, FileNotFoundError) as error:
                self._refused("snapshot", self.bucket.layout.snapshot_key(version), error)
        try:
            self.replica = GlobalReplica.initial(
                self.fragments, self.initial, head, self.bucket, self.secret, sync.window_versions, self.owned
            )
        except CorruptPayload as error:
            if self.initial_weights != "differ":
                log.error("refusing to reduce: %s", error)
            self.initial_weights = "differ"
            self._write_status()
            return False
        self.initial_weights = "match"
        self._restore_errors(head)
        if not self.bucket.snapshot_versions():  # a learner that cannot build version 0 itself reads it here
            self.bucket.write_snapshot(Version(0), self.replica.snapshot())
            self.snapshot_version = Version(0)
        log.info("the region's copy starts from version 0, built here from the recipe's seed")
        return True

    def _restore_errors(self, head: Head) -> None:
        reducer = reducer_of(self.region)
        marks = {FragmentIndex(int(p)): s for p, s in head.merged.get(reducer, {}).items()}
        in_flight: dict[FragmentIndex, list[int]] = {}
        for record in self.in_flight.values():
            in_flight.setdefault(record.fragment, []).append(record.serial)
        self.aggregation.restore(in_flight, marks)

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

    def _check_own_objects(self) -> None:
        """What the reducer wrote in the region's bucket and counts on, gone from it (the
        bucket wiped and recreated, or objects deleted): its epoch record is written
        again, so that a restart never repeats an aggregate's serial, and an aggregate in
        flight that vanished never reaches the syncer: it is void (its error feedback goes
        back, and those of its sends still in the region wait again)."""
        name = self.bucket.layout.reducer_name
        try:
            if self.bucket.read_epoch(name) < self.aggregation.epoch:
                self.bucket.write_epoch(name, self.aggregation.epoch)
                log.warning("the region's bucket lost this reducer's epoch record (was it wiped?): wrote it again")
        except (PayloadError, StorageError) as error:
            log.warning("the reducer's epoch record cannot be checked now: %s", error)
        try:
            present = set(store.aggregate_keys(self.bucket))
        except StorageError as error:
            log.warning("the reducer's aggregates cannot be listed now: %s", error)
            return
        for key, record in sorted(self.in_flight.items(), key=lambda item: item[1].serial):
            if key not in present:
                del self.in_flight[key]
                self.aggregation.resolved(record.fragment, record.serial, merged=False)
                self.counts["voided"] += 1
                log.warning("aggregate %s vanished from the region's bucket before it was resolved: void", key)

    # -------------------------------------------------------------------- resolving

    def _resolve(self, head: Head) -> None:
        """Aggregates the syncer is done with: merged (the fragment moved on and the
        head's ``merged`` marks cover every send in it: its payloads go), or discarded
        (the fragment moved on without it, or a send in it was merged already: its other
        sends wait again, its error feedback goes back)."""
        replica = self.replica
        for key, record in sorted(self.in_flight.items(), key=lambda item: item[1].serial):
            # one that holds only sends to resync was taken in at sight: it waits for nothing
            moved_on = record.anchor < replica.versions[record.fragment] or (head.finished and not record.sends)
            covered = [s for s in record.sends if s.sequence <= head.merged_sequence(s.learner, record.fragment)]
            if not moved_on and not covered:
                continue
            merged = moved_on and len(covered) == len(record.sends)
            try:
                for send in record.sends + record.resync if merged else covered:
                    self._consumed(send.key)
                store.delete_aggregate(self.bucket, key)
            except StorageError as error:
                log.warning("could not clear aggregate %s (tried again later): %s", key, error)
                continue
            self.aggregation.resolved(record.fragment, record.serial, merged)
            del self.in_flight[key]
            if not merged:
                self.counts["voided"] += 1
                log.info("aggregate %s was not merged: forwarding its sends again", key)

    def _consumed(self, key: str) -> None:
        """A payload the syncer merged (or retired): deleted, or kept but never read
        again when the recipe keeps consumed payloads (``sync.delete_consumed_payloads``)."""
        if not self.spec.keeps_payloads:
            self.bucket.delete_payload(key)
        self.consumed.add(key)

    # ----------------------------------------------------------------------- looking

    def _read_heartbeats(self) -> bool:
        """Take in the region's heartbeats; whether a learner stopped going on (finished,
        stopped, failed) since the last read."""
        now = self.clock()
        stopped_going = False
        for learner in (spec.id for spec in self.spec.learners if spec.region == self.region):
            try:
                beat: Heartbeat | None = self.bucket.read_heartbeat(learner)
            except PayloadError as error:
                self._refused("heartbeat", heartbeat_key(learner), error)
                continue
            except StorageError as error:
                log.warning("the heartbeat of %s cannot be read now: %s", learner, error)
                continue
            if beat is None:
                continue
            heard = self.heard.hear(learner, beat)
            if heard.replay is not None and not heard.counted_before:
                self._refused("heartbeat", heartbeat_key(learner), PayloadError(heard.replay))
            if heard.news:
                newest, previous = self.heard.newest[learner], self.heartbeats.get(learner)
                self.heartbeats[learner] = (newest.time, newest.state.value, now)
                was_going = previous is None or previous[1] not in GONE_STATES
                stopped_going |= was_going and newest.state.value in GONE_STATES
            if heard.replay is not None:
                continue
            for note in beat.refusals.recent:
                seen = (learner, note.key, note.time)
                match = self.bucket.layout.snapshot_pattern.match(note.key)
                if note.kind == "snapshot" and match and seen not in self.reported:
                    self.reported.add(seen)
                    self.damaged_snapshots.add(Version(int(match["version"])))
        return stopped_going

    def _follow_manifest(self) -> None:
        """Learners added or drained (``diloco scale``): the region's share and who may
        still send follow."""
        spec = self.manifest.changed() if self.manifest else None
        if spec is not None and (spec.run, spec.created) == (self.spec.run, self.spec.created):
            self.spec = spec

    def _live(self) -> set[LearnerId]:
        """The region's learners that may still send: not gone, heard from lately (or
        not yet heard from while the run is young)."""
        timeout = self.recipe.sync.liveness_timeout_seconds
        now = self.clock()
        live = set()
        for spec in self.spec.active_learners:
            if spec.region != self.region:
                continue
            seen = self.heartbeats.get(spec.id)
            if seen is None:
                if now - self._started_clock < timeout:
                    live.add(spec.id)
            elif seen[1] not in GONE_STATES and now - seen[2] <= timeout:
                live.add(spec.id)
        return live

    def _look(self, head: Head, now: float) -> None:
        """New payloads of the region's learners; those the syncer merged are deleted."""
        try:
            keys = self.bucket.payload_keys()
        except StorageError as error:
            log.warning("the region's payloads cannot be listed now: %s", error)
            return
        self._let_go_of_relays()
        held = {send.key for record in self.in_flight.values() for send in record.sends + record.resync}
        held |= {relayed_payload_key(key) for key in self.relayed}
        present = set(keys)
        self.waiting = {key: item for key, item in self.waiting.items() if key in present}
        self.consumed &= present
        self.refused_payloads = {key for key in self.refused_payloads if not _merged_past(key, head)}
        refused = []
        for key in filter(self._owns, keys):
            if key in held or key in self.consumed:
                continue
            try:
                record = self.records.get(key) or self.bucket.payload_record(key)
            except FileNotFoundError:
                continue
            except PayloadError as error:
                self._refused("marker", key, error)
                refused.append(key)
                continue
            except StorageError as error:
                log.warning("payloads after %s wait for a later turn: %s", key, error)
                break
            if record.sequence <= head.merged_sequence(record.learner, record.fragment):
                self._consumed(key)  # merged (or superseded by a merged send)
                self.records.pop(key, None)
                self.waiting.pop(key, None)
                continue
            self.records[key] = record
            if key not in self.waiting:
                self.waiting[key] = Waiting(record.fragment, send_of(record), now)
        self._remove_refused(refused)

    # ---------------------------------------------------------------------- forwarding

    def _let_go_of_relays(self) -> None:
        """Relays the syncer deleted: it merged or retired their sends (a retired send's
        learner is told to resync, or its payload was refused), so their payloads go."""
        if not self.relayed:
            return
        try:
            present = set(self.bucket.relay_keys())
        except StorageError as error:
            log.warning("the region's relays cannot be listed now: %s", error)
            return
        for key in [key for key in self.relayed if key not in present]:
            record = self.relayed.pop(key)
            try:
                self._consumed(relayed_payload_key(key))
            except StorageError as error:
                log.warning("could not delete the payload of relay %s (tried again later): %s", key, error)
                self.relayed[key] = record

    def _forward(self, now: float) -> None:
        policy, live = self._policy(), self._live()
        if policy.relays:
            for item in to_relay(self.waiting.values()):
                self._relay(self.records[item.send.key])
            return
        for fragment in (f.index for f in self.owned):
            reached = self.replica.versions[fragment]  # a send from a newer base waits until the replica has it
            waiting = [i for i in self.waiting.values() if i.fragment == fragment and i.send.base_version <= reached]
            in_flight = {s.learner for r in self.in_flight.values() if r.fragment == fragment for s in r.sends}
            chosen = to_forward(waiting, in_flight, live, policy, now)
            if chosen:
                self._send(fragment, [self.records[item.send.key] for item in chosen])

    def _relay(self, record: PayloadRecord) -> None:
        """Copy a verified send to its relay key, for the syncer to anchor itself."""
        try:
            blob = self.bucket.read_payload(record.key)
            check_announced(record, blob, self.secret)
            key = self.bucket.relay(record.key, blob)
        except (PayloadError, FileNotFoundError) as error:
            self._refused("payload", record.key, error)
            self.waiting.pop(record.key, None)
            self._remove_refused([record.key])
            return
        except StorageError as error:
            log.warning("%s not relayed (tried again later): %s", record.key, error)
            return
        self.waiting.pop(record.key, None)
        self.relayed[key] = record
        self.counts["sends"] += 1
        log.info(
            "relayed %s: fragment %d from %s, base version %d",
            key,
            record.fragment,
            record.learner,
            record.base_version,
        )

    def _send(self, fragment: FragmentIndex, records: list[PayloadRecord]) -> None:
        try:
            built = self.aggregation.build(fragment, records, self.replica, self._refused)
        except DamagedWindowUpdate as error:  # reported in the status: the syncer rewrites it, then the sends go
            self._refused("update", error.key, error)
            return
        except StorageError as error:
            log.warning("aggregate of fragment %d not written (tried again later): %s", fragment, error)
            return
        for send, _ in built.refused:
            self.waiting.pop(send.key, None)
        self._remove_refused([send.key for send, _ in built.refused])
        if built.key is None:
            return
        for send in built.merged + built.resync:
            self.waiting.pop(send.key, None)
        self.in_flight[built.key] = store.aggregate_record(self.bucket, built.key)
        self.counts["aggregates"] += 1
        self.counts["sends"] += len(built.merged)
        learners = ", ".join(sorted({send.learner for send in built.merged})) or "nobody"
        log.info(
            "aggregate %s: fragment %d from %s at version %d",
            built.key,
            fragment,
            learners,
            self.replica.versions[fragment],
        )

    def _remove_refused(self, keys: list[str]) -> None:
        """Payloads refused (their marker or their body): listed in the status first, for
        the syncer's ledger to retire them, then removed.  A status that cannot be written
        now leaves them in place, refused again at a later turn."""
        if not keys:
            return
        self.refused_payloads.update(keys)
        if not self._write_status():
            return
        for key in keys:
            self.bucket.delete_payload(key)

    # ------------------------------------------------------------------------ report

    def _refused(self, kind: str, key: str, error: Exception) -> None:
        reason, now = str(error), time.time()
        self._last_refused = {seen: at for seen, at in self._last_refused.items() if now - at < REPEAT_SECONDS}
        if (kind, key, reason) in self._last_refused:
            return
        self._last_refused[(kind, key, reason)] = now
        log.warning("refusing %s %s: %s", kind, key, reason)
        self.refusals.record(kind, key, reason, now)

    def status(self) -> ReducerStatus:
        replica = self.replica
        in_flight: dict[FragmentIndex, list[LearnerId]] = {}
        for record in self.in_flight.values():
            if record.sends:  # one without sends holds nothing the syncer waits for
                in_flight.setdefault(record.fragment, []).extend(send.learner for send in record.sends)
        for relayed in self.relayed.values():
            in_flight.setdefault(relayed.fragment, []).append(relayed.learner)
        waiting: dict[FragmentIndex, list[LearnerId]] = {}
        for item in self.waiting.values():
            waiting.setdefault(item.fragment, []).append(item.send.learner)
        return ReducerStatus(
            region=self.region,
            version=replica.version if replica else Version(0),
            fragment_versions=dict(replica.versions) if replica else {},
            aggregates=self.counts["aggregates"],
            sends=self.counts["sends"],
            voided=self.counts["voided"],
            in_flight={p: sorted(set(learners)) for p, learners in in_flight.items()},
            waiting={p: sorted(set(learners)) for p, learners in waiting.items()},
            snapshot_version=max(self.snapshot_version, Version(0)),
            initial_weights=self.initial_weights,
            heartbeats_seen={learner: seen[0] for learner, seen in self.heartbeats.items()},
            heartbeats=HeartbeatHeard.of(self.heard.newest),
            needs_snapshot=self.needs_snapshot,
            storage=self.storage_before.plus(self.bucket.store.meter.snapshot()),
            refusals=self.refusals,
            refused_payloads=sorted(self.refused_payloads),
            finished=self.finished,
            started_at=self.started_at,
            time=time.time(),
        )

    def _write_status(self) -> bool:
        """Write the status; whether it was written."""
        try:
            store.write_reducer_status(self.bucket, self.status())
            self.report_soon = False
            return True
        except StorageError as error:
            log.warning("could not write the reducer's status: %s", error)
            return False


def _merged_past(key: str, head: Head) -> bool:
    """Whether a merge of the payload's learner and fragment passed it (the ledger no
    longer needs it retired)."""
    match = PAYLOAD_KEY.match(key)
    return match is None or int(match["sequence"]) <= head.merged_sequence(
        LearnerId(match["learner"]), FragmentIndex(int(match["fragment"]))
    )


def run_reducers(reducers: list[Reducer]) -> int:
    """Run a region's reducers (one per syncer shard) in this process, each turn in turn,
    until every one has finished or a signal (SIGTERM, SIGINT) stops them."""
    stop = []

    def request_stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after this turn", signum)
        stop.append(signum)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    for reducer in reducers:
        reducer.start()
    clock = reducers[0].clock
    while not stop:
        wake = min(reducer.turn() for reducer in reducers if not reducer.finished)
        if all(reducer.finished for reducer in reducers):
            return EXIT_FINISHED
        time.sleep(max(0.0, wake - clock()))
    for reducer in reducers:
        reducer._write_status()
    return EXIT_STOPPED
