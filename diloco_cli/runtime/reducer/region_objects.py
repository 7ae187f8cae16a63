"""The reducer's hands in its region's bucket: what it reads for its decisions, and what
it does for them.

The reducer decides with the pure :func:`diloco_cli.core.reducer_step.step`;
:class:`RegionObjects` turns the region's bucket into its observations (the payloads of
the region's learners with their markers verified, the relays and the aggregates still
there) and carries out its actions: deleting what was consumed, copying a send to its
relay, building and writing an aggregate (:mod:`.aggregation`), removing refused
payloads once the reducer's status lists them.  What an action came to is returned as
observations, for the state to take in.  It also keeps the aggregates' serials above
every one the syncer merged, and gives a restarted reducer its error feedback back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from diloco_cli.codec import PayloadError
from diloco_cli.core import reducer_step as step
from diloco_cli.core.reducer_step import ReducerState
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.runtime.coordinator import RefusalCount
from diloco_cli.runtime.outer_gradients import check_announced
from diloco_cli.runtime.reducer.aggregation import Aggregation
from diloco_cli.runtime.reducer.region_copy import RegionCopy
from diloco_cli.runtime.reducer.replica import DamagedWindowUpdate
from diloco_cli.store import aggregates as store
from diloco_cli.store.aggregates import AGGREGATE_KEY, AggregateRecord, reducer_of
from diloco_cli.store.documents import Head
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import PAYLOAD_KEY, RELAY_KEY, SEQUENCE_PER_EPOCH, PayloadRecord

log = logging.getLogger("diloco.reducer")


class RegionObjects:
    """A reducer's payloads, relays and aggregates in its region's bucket (of the
    fragments ``owns`` says are its own, with syncer shards)."""

    def __init__(
        self,
        aggregation: Aggregation,
        copy: RegionCopy,
        refusals: RefusalCount,
        owns: Callable[[FragmentIndex], bool],
        delete_consumed: bool,
        write_status: Callable[[], bool],
    ) -> None:
        self.bucket, self.secret = aggregation.bucket, aggregation.secret
        """The region's bucket (the aggregates'), and the run's secret."""
        self.aggregation, self.copy = aggregation, copy
        self.refusals, self.owns_fragment = refusals, owns
        self.delete_consumed = delete_consumed
        """Whether consumed payloads are deleted (not under ``--chaos keep-payloads``)."""
        self.write_status = write_status
        self.wiped = False
        """The region's bucket was found wiped since the reducer last looked (its epoch
        record gone): the loop tells its heartbeat reader, then clears it."""

    def owns(self, key: str) -> bool:
        """Whether a payload, relay or aggregate key is of this reducer's fragments."""
        match = PAYLOAD_KEY.match(key) or RELAY_KEY.match(key) or AGGREGATE_KEY.match(key)
        return match is not None and self.owns_fragment(int(match["fragment"]))

    # ----------------------------------------------------------------- aggregates

    def number_after(self, head: Head) -> bool:
        """Number this start's aggregates above every one the syncer merged from the
        region (the head's marks): with the bucket wiped, the epoch record this start
        counted from is gone, and a serial used again would be taken for one consumed.
        False while the epoch record cannot be written."""
        marks = head.merged.get(reducer_of(self.bucket.name), {})
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
        self.wiped = True
        self.aggregation.epoch = merged_epoch + 1
        return True

    def restore_errors(self, head: Head, state: ReducerState) -> None:
        """The error feedback of the aggregates in flight, and of the newest the syncer
        merged, back from the region's bucket (a restarted reducer goes on with it)."""
        reducer = reducer_of(self.bucket.name)
        marks = {FragmentIndex(int(p)): s for p, s in head.merged.get(reducer, {}).items()}
        in_flight: dict[FragmentIndex, list[int]] = {}
        for record in state.in_flight.values():
            in_flight.setdefault(record.fragment, []).append(record.serial)
        self.aggregation.restore(in_flight, marks)

    # ------------------------------------------------------------------- reading

    def left_by_an_earlier_start(self) -> ReducerState:
        """What a killed reducer left in flight: its aggregates (from their markers) and
        its relays the syncer has not let go of."""
        in_flight: dict[str, AggregateRecord] = {}
        for key in filter(self.owns, store.aggregate_keys(self.bucket)):
            try:
                in_flight[key] = store.aggregate_record(self.bucket, key)
            except PayloadError as error:
                self.refusals.refused("aggregate", key, error)
                store.delete_aggregate(self.bucket, key)
            except FileNotFoundError:
                continue
        relayed: dict[str, PayloadRecord] = {}
        for key in filter(self.owns, self.bucket.relay_keys()):
            try:
                relayed[key] = self.bucket.payload_record(key)
            except (PayloadError, FileNotFoundError):
                continue  # the syncer refuses (and deletes) a relay whose marker is not authentic
        return ReducerState(in_flight=in_flight, relayed=relayed)

    def own_objects(self) -> list[step.Observation]:
        """What the reducer wrote and counts on, checked (the bucket wiped and recreated,
        or objects deleted): its epoch record is written again, so that a restart never
        repeats an aggregate's serial; the aggregates still there are listed (one in
        flight that vanished never reaches the syncer: it is void)."""
        name = self.bucket.layout.reducer_name
        try:
            if self.bucket.read_epoch(name) < self.aggregation.epoch:
                self.bucket.write_epoch(name, self.aggregation.epoch)
                log.warning("the region's bucket lost this reducer's epoch record (was it wiped?): wrote it again")
                self.wiped = True
        except (PayloadError, StorageError) as error:
            log.warning("the reducer's epoch record cannot be checked now: %s", error)
        try:
            return [step.AggregatesListed(frozenset(store.aggregate_keys(self.bucket)))]
        except StorageError as error:
            log.warning("the reducer's aggregates cannot be listed now: %s", error)
            return []

    def payloads(self, state: ReducerState, head: Head) -> list[step.Observation]:
        """The region's payloads (the markers not read yet, verified) and, with relays out,
        the relays still there; nothing while the payloads cannot be listed."""
        try:
            keys = [key for key in self.bucket.payload_keys() if self.owns(key)]
        except StorageError as error:
            log.warning("the region's payloads cannot be listed now: %s", error)
            return []
        observations: list[step.Observation] = []
        if state.relayed:
            try:
                observations.append(step.RelaysListed(frozenset(self.bucket.relay_keys())))
            except StorageError as error:
                log.warning("the region's relays cannot be listed now: %s", error)
        read: dict[str, PayloadRecord] = {}
        refused: list[str] = []
        cut_at = None
        for key in state.to_read(keys):
            try:
                read[key] = self.bucket.payload_record(key)
            except FileNotFoundError:
                continue
            except PayloadError as error:
                self.refusals.refused("marker", key, error)
                refused.append(key)
            except StorageError as error:
                log.warning("payloads after %s wait for a later turn: %s", key, error)
                cut_at = key
                break
        passed = frozenset(_merged_past(state.refused_payloads, head))
        observations.append(step.PayloadsListed(head, tuple(keys), read, tuple(refused), passed, cut_at))
        return observations

    # ------------------------------------------------------------------- acting

    def act(self, action: step.Action) -> list[step.Observation]:
        """Carry out one action; what it came to."""
        if isinstance(action, step.VoidAggregate):
            record = action.record
            self.aggregation.resolved(record.fragment, record.serial, merged=False)
            log.warning("aggregate %s vanished from the region's bucket before it was resolved: void", record.key)
        elif isinstance(action, step.ClearAggregate):
            return self._clear(action)
        elif isinstance(action, step.ReleaseRelay):
            try:
                self._consume(action.record.key)
            except StorageError as error:
                log.warning("could not delete the payload of relay %s (tried again later): %s", action.key, error)
                return []
            return [step.RelayReleased(action.key)]
        elif isinstance(action, step.Consume):
            self._consume(action.key)
        elif isinstance(action, step.RemoveRefused):
            self._remove_refused(action.keys)
        elif isinstance(action, step.Relay):
            return self._relay(action.record)
        elif isinstance(action, step.Forward):
            return self._forward(action.fragment, list(action.records))
        return []

    def _consume(self, key: str) -> None:
        """A payload the syncer merged (or retired): deleted, or kept but never read
        again when the recipe keeps consumed payloads."""
        if self.delete_consumed:
            self.bucket.delete_payload(key)

    def _clear(self, action: step.ClearAggregate) -> list[step.Observation]:
        """An aggregate the syncer is done with: its consumed payloads, then it, deleted;
        discarded, its error feedback goes back and its other sends wait again."""
        record = action.record
        try:
            for key in action.consumed:
                self._consume(key)
            store.delete_aggregate(self.bucket, record.key)
        except StorageError as error:
            log.warning("could not clear aggregate %s (tried again later): %s", record.key, error)
            return []
        self.aggregation.resolved(record.fragment, record.serial, action.merged)
        if not action.merged:
            log.info("aggregate %s was not merged: forwarding its sends again", record.key)
        return [step.AggregateCleared(record.key, action.merged, action.consumed)]

    def _relay(self, record: PayloadRecord) -> list[step.Observation]:
        """Copy a verified send to its relay key, for the syncer to anchor itself."""
        try:
            blob = self.bucket.read_payload(record.key)
            check_announced(record, blob, self.secret)
            key = self.bucket.relay(record.key, blob)
        except (PayloadError, FileNotFoundError) as error:
            self.refusals.refused("payload", record.key, error)
            return [step.PayloadsRefused((record.key,))]
        except StorageError as error:
            log.warning("%s not relayed (tried again later): %s", record.key, error)
            return []
        log.info(
            "relayed %s: fragment %d from %s, base version %d",
            key,
            record.fragment,
            record.learner,
            record.base_version,
        )
        return [step.Relayed(key, record)]

    def _forward(self, fragment: FragmentIndex, records: list[PayloadRecord]) -> list[step.Observation]:
        """Merge the sends into one aggregate of the fragment, anchored at the region's
        copy, and write it."""
        replica = self.copy.replica
        try:
            built = self.aggregation.build(fragment, records, replica, self.refusals.refused)
        except DamagedWindowUpdate as error:  # reported in the status: the syncer rewrites it, then the sends go
            self.refusals.refused("update", error.key, error)
            return []
        except StorageError as error:
            log.warning("aggregate of fragment %d not written (tried again later): %s", fragment, error)
            return []
        outcomes: list[step.Observation] = []
        if built.refused:
            outcomes.append(step.PayloadsRefused(tuple(send.key for send, _ in built.refused)))
        if built.key is None:
            return outcomes
        outcomes.append(step.AggregateWritten(store.aggregate_record(self.bucket, built.key)))
        learners = ", ".join(sorted({send.learner for send in built.merged})) or "nobody"
        version = replica.versions[fragment]
        log.info("aggregate %s: fragment %d from %s at version %d", built.key, fragment, learners, version)
        return outcomes

    def _remove_refused(self, keys: tuple[str, ...]) -> None:
        """Payloads refused (their marker or their body), listed in the status (the state
        holds them already), then removed.  A status that cannot be written now leaves
        them in place, refused again at a later turn."""
        if not self.write_status():
            return
        for key in keys:
            self.bucket.delete_payload(key)


def _merged_past(keys: Iterable[str], head: Head) -> list[str]:
    """Of refused payloads, those a merge of the same learner and fragment passed (the
    ledger no longer needs them retired)."""
    passed = []
    for key in keys:
        match = PAYLOAD_KEY.match(key)
        if match is None or int(match["sequence"]) <= head.merged_sequence(
            LearnerId(match["learner"]), FragmentIndex(int(match["fragment"]))
        ):
            passed.append(key)
    return passed
