"""A region's reducer's decisions as a pure state machine: ``step(state, observations, now)``.

The reducer (``runtime/reducer/``) holds its region's sends until they are worth a WAN
upload (docs/algorithm.md, "Reducers", 5): under K = M it forwards them as one aggregate
per fragment and round (:func:`~diloco_cli.core.forwarding.to_forward`), under K < M it
relays each send as it is (:func:`~diloco_cli.core.forwarding.to_relay`).  What it holds
is :class:`ReducerState`: the sends waiting, the aggregates in flight, the relays the
syncer has not let go of, the payloads consumed or refused.  Its loop reads the region's
bucket and the head, hands what it read to :func:`step` as observations, and carries out
the actions; what an action's I/O came to (an aggregate written, a relay copied, a send
refused) comes back as an observation, folded at once.

The resolving rules, from the head's ``merged`` marks (the newest send merged per learner
and fragment) and the fragment versions of the region's copy:

* an aggregate whose fragment moved on and whose every send the marks cover was merged:
  its sends (and those it asked to resync) are consumed;
* one whose fragment moved on without it, or one of whose sends a merge covers already,
  was discarded: the covered sends are consumed, the others wait again (its error
  feedback goes back), and it counts as voided;
* one that vanished from the region's bucket before it was resolved is void;
* a relay the syncer deleted was merged or retired: its payload goes;
* a payload the marks cover was merged (or superseded by a merged send): consumed.

Nothing here does I/O or reads a clock; the records are the store's markers, read
through the small protocols below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from diloco_cli.core.forwarding import ForwardPolicy, Send, Waiting, to_forward, to_relay
from diloco_cli.core.types import FragmentIndex, LearnerId, Version

# ---------------------------------------------------------------------------- records


class Payload(Send, Protocol):
    """A learner's payload as its marker describes it."""

    @property
    def fragment(self) -> FragmentIndex: ...


class Aggregate(Protocol):
    """An aggregate as its marker describes it."""

    @property
    def key(self) -> str: ...

    @property
    def fragment(self) -> FragmentIndex: ...

    @property
    def serial(self) -> int: ...

    @property
    def anchor(self) -> Version: ...

    @property
    def sends(self) -> tuple[Send, ...]: ...

    @property
    def resync(self) -> tuple[Send, ...]: ...


class MergedMarks(Protocol):
    """What the reducer reads of the head to resolve what it forwarded."""

    finished: bool

    def merged_sequence(self, learner: LearnerId, fragment: FragmentIndex) -> int: ...


# ----------------------------------------------------------------------------- state


@dataclass(frozen=True)
class ReducerState:
    """What a region's reducer holds between two turns."""

    waiting: Mapping[str, Waiting] = field(default_factory=dict)
    """Sends not forwarded (or relayed) yet, by payload key."""
    records: Mapping[str, Payload] = field(default_factory=dict)
    """Markers read, by payload key (read once, while the payload is not consumed)."""
    consumed: frozenset[str] = frozenset()
    """Payloads known merged or retired (still listed when consumed payloads are kept)."""
    in_flight: Mapping[str, Aggregate] = field(default_factory=dict)
    """Aggregates forwarded and not resolved yet, by key."""
    relayed: Mapping[str, Payload] = field(default_factory=dict)
    """Sends relayed (under K < M) that the syncer has not let go yet, by relay key."""
    refused_payloads: frozenset[str] = frozenset()
    """Payloads refused, listed in the status until a merge of the same learner and
    fragment passes them (the syncer's ledger retires them)."""
    counts: Mapping[str, int] = field(default_factory=lambda: {"aggregates": 0, "sends": 0, "voided": 0})
    """Aggregates written, sends forwarded (in aggregates or relayed), aggregates voided."""

    @property
    def holding(self) -> bool:
        """Whether any send is held: waiting, in an aggregate in flight, or relayed."""
        return bool(self.waiting or self.in_flight or self.relayed)

    @property
    def held_keys(self) -> frozenset[str]:
        """Payloads in an aggregate in flight or relayed: not to be looked at again."""
        held = {send.key for record in self.in_flight.values() for send in (*record.sends, *record.resync)}
        return frozenset(held | {record.key for record in self.relayed.values()})

    def to_read(self, keys: Iterable[str]) -> list[str]:
        """Of the payloads listed, those whose marker the reducer has not read yet."""
        skip = self.held_keys | self.consumed
        return [key for key in keys if key not in skip and key not in self.records]


def _count(state: ReducerState, name: str, more: int = 1) -> Mapping[str, int]:
    return {**state.counts, name: state.counts[name] + more}


def _by_serial(in_flight: Mapping[str, Aggregate]) -> list[tuple[str, Aggregate]]:
    return sorted(in_flight.items(), key=lambda item: item[1].serial)


# ---------------------------------------------------------------------- observations


@dataclass(frozen=True)
class AggregatesListed:
    """The aggregates present in the region's bucket."""

    present: frozenset[str]


@dataclass(frozen=True)
class HeadSeen:
    """The head, with the fragment versions the region's copy reached from it."""

    head: MergedMarks
    fragment_versions: Mapping[FragmentIndex, Version]


@dataclass(frozen=True)
class AggregateCleared:
    """An aggregate the syncer was done with, deleted with the payloads it consumed."""

    key: str
    merged: bool
    consumed: tuple[str, ...]


@dataclass(frozen=True)
class RelaysListed:
    """The relays present in the region's bucket."""

    present: frozenset[str]


@dataclass(frozen=True)
class RelayReleased:
    """A relay the syncer let go of, whose payload the reducer consumed."""

    key: str


@dataclass(frozen=True)
class PayloadsListed:
    """The region's payloads: every key listed, the markers read now
    (:meth:`ReducerState.to_read`), and those whose marker was refused."""

    head: MergedMarks
    present: tuple[str, ...]
    """The keys of this reducer's payloads, in listing order."""
    read: Mapping[str, Payload]
    refused: tuple[str, ...] = ()
    merged_past: frozenset[str] = frozenset()
    """Refused payloads a merge of the same learner and fragment passed (no longer listed)."""
    cut_at: str | None = None
    """The payload whose marker could not be read now (storage): it and those listed
    after it wait for a later turn."""


@dataclass(frozen=True)
class ForwardingDue:
    """Time to forward (or relay) what waits."""

    policy: ForwardPolicy
    live: frozenset[LearnerId]
    """The region's learners that may still send."""
    fragment_versions: Mapping[FragmentIndex, Version]
    """How far the region's copy reached: a send from a newer base waits for it."""


@dataclass(frozen=True)
class Relayed:
    """A send copied to its relay key."""

    key: str
    record: Payload


@dataclass(frozen=True)
class AggregateWritten:
    """An aggregate forwarded: the sends it merged, and those it asks to resync."""

    record: Aggregate


@dataclass(frozen=True)
class PayloadsRefused:
    """Sends whose payload was refused while relaying or aggregating them."""

    keys: tuple[str, ...]


Observation = (
    AggregatesListed
    | HeadSeen
    | AggregateCleared
    | RelaysListed
    | RelayReleased
    | PayloadsListed
    | ForwardingDue
    | Relayed
    | AggregateWritten
    | PayloadsRefused
)

# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class VoidAggregate:
    """An aggregate in flight that vanished: its error feedback goes back."""

    record: Aggregate


@dataclass(frozen=True)
class ClearAggregate:
    """Delete an aggregate the syncer is done with, consuming ``consumed`` first."""

    record: Aggregate
    merged: bool
    consumed: tuple[str, ...]


@dataclass(frozen=True)
class ReleaseRelay:
    """Consume the payload of a relay the syncer deleted."""

    key: str
    record: Payload


@dataclass(frozen=True)
class Consume:
    """A payload merged (or superseded by a merged send): deleted, or kept unread."""

    key: str


@dataclass(frozen=True)
class RemoveRefused:
    """Payloads refused: report them in the status, then delete them."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class Relay:
    """Copy a send to its relay key for the syncer to anchor itself."""

    record: Payload


@dataclass(frozen=True)
class Forward:
    """Merge these sends of a fragment into one aggregate and write it."""

    fragment: FragmentIndex
    records: tuple[Payload, ...]


Action = VoidAggregate | ClearAggregate | ReleaseRelay | Consume | RemoveRefused | Relay | Forward

# ------------------------------------------------------------------------------ step


def step(state: ReducerState, observations: Iterable[Observation], now: float) -> tuple[ReducerState, list[Action]]:
    """Fold observations into the state, in order; each may call for actions."""
    actions: list[Action] = []
    for observation in observations:
        state = _observe(state, observation, now, actions)
    return state, actions


def _observe(state: ReducerState, observation: Observation, now: float, actions: list[Action]) -> ReducerState:
    if isinstance(observation, AggregatesListed):
        return _void_vanished(state, observation.present, actions)
    if isinstance(observation, HeadSeen):
        actions += _to_clear(state, observation.head, observation.fragment_versions)
        return state
    if isinstance(observation, AggregateCleared):
        in_flight = {key: record for key, record in state.in_flight.items() if key != observation.key}
        counts = state.counts if observation.merged else _count(state, "voided")
        return replace(state, in_flight=in_flight, counts=counts, consumed=state.consumed | set(observation.consumed))
    if isinstance(observation, RelaysListed):
        actions += [
            ReleaseRelay(key, record) for key, record in state.relayed.items() if key not in observation.present
        ]
        return state
    if isinstance(observation, RelayReleased):
        record = state.relayed[observation.key]
        relayed = {key: kept for key, kept in state.relayed.items() if key != observation.key}
        return replace(state, relayed=relayed, consumed=state.consumed | {record.key})
    if isinstance(observation, PayloadsListed):
        return _look(state, observation, now, actions)
    if isinstance(observation, ForwardingDue):
        actions += _to_forward(state, observation, now)
        return state
    if isinstance(observation, Relayed):
        waiting = {key: item for key, item in state.waiting.items() if key != observation.record.key}
        relayed = {**state.relayed, observation.key: observation.record}
        return replace(state, waiting=waiting, relayed=relayed, counts=_count(state, "sends"))
    if isinstance(observation, AggregateWritten):
        record = observation.record
        taken = {send.key for send in (*record.sends, *record.resync)}
        waiting = {key: item for key, item in state.waiting.items() if key not in taken}
        counts = {**_count(state, "aggregates"), "sends": state.counts["sends"] + len(record.sends)}
        return replace(state, waiting=waiting, in_flight={**state.in_flight, record.key: record}, counts=counts)
    if isinstance(observation, PayloadsRefused):
        return _refuse(state, observation.keys, actions)
    raise TypeError(f"not an observation of the reducer: {observation!r}")


def _void_vanished(state: ReducerState, present: frozenset[str], actions: list[Action]) -> ReducerState:
    """An aggregate in flight gone from the region's bucket (wiped, or deleted) never
    reaches the syncer: void (those of its sends still in the region wait again)."""
    vanished = [record for key, record in _by_serial(state.in_flight) if key not in present]
    if not vanished:
        return state
    actions += [VoidAggregate(record) for record in vanished]
    in_flight = {key: record for key, record in state.in_flight.items() if key in present}
    return replace(state, in_flight=in_flight, counts=_count(state, "voided", len(vanished)))


def _to_clear(
    state: ReducerState, head: MergedMarks, fragment_versions: Mapping[FragmentIndex, Version]
) -> list[ClearAggregate]:
    """Aggregates the syncer is done with: merged (the fragment moved on and the head's
    marks cover every send in it) or discarded (it moved on without it, or a send in it
    was merged already)."""
    cleared = []
    for _key, record in _by_serial(state.in_flight):
        # one that holds only sends to resync was taken in at sight: it waits for nothing
        moved_on = record.anchor < fragment_versions[record.fragment] or (head.finished and not record.sends)
        covered = [s for s in record.sends if s.sequence <= head.merged_sequence(s.learner, record.fragment)]
        if not moved_on and not covered:
            continue
        merged = moved_on and len(covered) == len(record.sends)
        consumed = (*record.sends, *record.resync) if merged else covered
        cleared.append(ClearAggregate(record, merged, tuple(send.key for send in consumed)))
    return cleared


def _look(state: ReducerState, listed: PayloadsListed, now: float, actions: list[Action]) -> ReducerState:
    """New payloads wait; those the head's marks cover are consumed."""
    present = set(listed.present)
    held = state.held_keys
    waiting = {key: item for key, item in state.waiting.items() if key in present}
    records = dict(state.records)
    consumed = set(state.consumed & present)
    for key in listed.present:
        if key == listed.cut_at:
            break
        if key in held or key in consumed:
            continue
        record = records.get(key) or listed.read.get(key)
        if record is None:
            continue  # vanished, refused, or not read this turn
        if record.sequence <= listed.head.merged_sequence(record.learner, record.fragment):
            actions.append(Consume(key))  # merged (or superseded by a merged send)
            consumed.add(key)
            records.pop(key, None)
            waiting.pop(key, None)
            continue
        records[key] = record
        if key not in waiting:
            waiting[key] = Waiting(record.fragment, record, now)
    state = replace(
        state,
        waiting=waiting,
        records=records,
        consumed=frozenset(consumed),
        refused_payloads=state.refused_payloads - listed.merged_past,
    )
    return _refuse(state, listed.refused, actions)


def _refuse(state: ReducerState, keys: tuple[str, ...], actions: list[Action]) -> ReducerState:
    """Refused payloads wait no more; listed in the status first (for the syncer's ledger
    to retire them), then removed."""
    if not keys:
        return state
    actions.append(RemoveRefused(keys))
    waiting = {key: item for key, item in state.waiting.items() if key not in keys}
    return replace(state, waiting=waiting, refused_payloads=state.refused_payloads | set(keys))


def _to_forward(state: ReducerState, due: ForwardingDue, now: float) -> list[Action]:
    """Under K < M every send not superseded is relayed at once; under K = M each
    fragment's sends go as one aggregate when the forwarding says so."""
    if due.policy.relays:
        return [Relay(state.records[item.send.key]) for item in to_relay(state.waiting.values())]
    forwards: list[Action] = []
    for fragment in sorted({item.fragment for item in state.waiting.values()}):
        reached = due.fragment_versions[fragment]  # a send from a newer base waits until the copy has it
        waiting = [i for i in state.waiting.values() if i.fragment == fragment and i.send.base_version <= reached]
        in_flight = {s.learner for r in state.in_flight.values() if r.fragment == fragment for s in r.sends}
        chosen = to_forward(waiting, in_flight, due.live, due.policy, now)
        if chosen:
            forwards.append(Forward(fragment, tuple(state.records[item.send.key] for item in chosen)))
    return forwards
