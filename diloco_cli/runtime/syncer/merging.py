"""Carrying out one merge the decisions asked for: read, verify, merge, commit, publish.

The order is what makes a killed syncer lose nothing and merge nothing twice
(docs/protocol.md): the arrivals' bytes are read (from the read-ahead, else now) and
checked to be the very sends their markers announced; the round is computed
(:meth:`Merger.compute`, :func:`~.merge_round.merge_round`); the version is evaluated
when due; the new version is committed to the home store with its ledger entry, listing
the payloads it merged and those retired unmerged since the last commit
(:meth:`Merger.commit`, :func:`~.state.commit_merge`); only then is it published to
every region, and the consumed payloads deleted.

The merger touches no region: it is given what the observer holds (:class:`MergeInputs`)
and returns a :class:`MergeOutcome` (what it refused, retired, committed and must be
published) that the syncer's loop applies, in that order
(:meth:`~.loop.Syncer._apply_merge`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from diloco_cli.codec import CorruptPayload, PayloadError, read_header
from diloco_cli.codec.parallel import resolve_threads
from diloco_cli.core import decisions
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.ledger import PayloadId
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.runtime.outer_gradients import check_announced
from diloco_cli.runtime.syncer.context import SyncerContext
from diloco_cli.runtime.syncer.merge_round import AggregateInput, RoundInput, RoundResult, merge_round
from diloco_cli.runtime.syncer.region_scan import payload_id
from diloco_cli.runtime.syncer.state import SyncerState, commit_merge
from diloco_cli.runtime.workspace import MergeWorkspace
from diloco_cli.store.aggregates import AggregateRecord
from diloco_cli.store.documents import Evaluation, LastMerge
from diloco_cli.store.home import CommitRecord, MergedAggregate, MergedPayload, RetiredPayload, UnanchoredSend
from diloco_cli.store.region import RELAY_KEY, PayloadRecord

log = logging.getLogger("diloco.syncer")


@dataclass(frozen=True)
class MergeInputs:
    """What the observer holds for one merge, as the loop read it."""

    blobs: Mapping[str, bytes | None]
    """The bytes of the merge's arrivals (None for one that vanished), by qualified key."""
    records: Mapping[str, PayloadRecord | AggregateRecord]
    """The markers of the payloads observed and not consumed yet, by qualified key."""
    retiring: Mapping[str, PayloadId]
    """The payloads consumed unmerged since the last commit (the next record lists them)."""
    unanchored: tuple[UnanchoredSend, ...]
    """Those of them refused because their base could not be anchored (their learners told to resync)."""
    started: float
    """When the merge began (syncer clock), before its bytes were read."""


@dataclass(frozen=True)
class Refusal:
    """A payload or aggregate refused before it was merged (it is retired too)."""

    region: str
    kind: str
    key: str
    error: Exception


@dataclass(frozen=True)
class Committed:
    """A version committed to the home store: to publish, then its payloads to let go."""

    version: Version
    fragment: FragmentIndex
    payload: bytes
    """The outer update to publish to every region."""
    consumed: tuple[str, ...]
    """The payloads the commit consumed (merged, or retired and listed), to forget."""
    relays: tuple[str, ...]
    """Of those, the relayed copies: the syncer's to delete (their reducer then lets the payload go)."""
    merge: LastMerge


@dataclass(frozen=True)
class MergeOutcome:
    """What a merge did, for the loop to apply: its refusals and retired payloads (to
    the observer), the version it committed (to publish), and what it tells the
    decisions (finished or aborted)."""

    observation: decisions.Observation
    refused: tuple[Refusal, ...] = ()
    retired: tuple[PayloadId, ...] = ()
    """Consumed unmerged by this merge (superseded or refused): listed by its commit, if any."""
    committed: Committed | None = None

    @property
    def merged(self) -> LastMerge | None:
        return self.committed.merge if self.committed is not None else None


@dataclass(frozen=True)
class ComputedRound:
    """A round merged in memory, not committed yet: evaluated when due, then
    committed (:meth:`Merger.commit`)."""

    action: decisions.Merge
    version: Version
    previous_version: Version
    result: RoundResult
    merged: tuple[decisions.Arrival, ...]
    merged_groups: tuple[str, ...]
    aggregates: tuple[MergedAggregate, ...]
    refused: tuple[Refusal, ...]
    retired: tuple[PayloadId, ...]
    retiring: Mapping[str, PayloadId]
    """Every payload the commit lists as retired: those before this merge, and its own."""
    unanchored: tuple[UnanchoredSend, ...]
    started: float
    merge_seconds: float


def arrival_keys(action: decisions.Merge) -> list[str]:
    """The payloads whose bytes a merge reads: each raw arrival, and each aggregate once."""
    raw = [arrival.key for arrival in action.arrivals if arrival.group is None]
    groups = dict.fromkeys(arrival.group for arrival in action.arrivals if arrival.group is not None)
    return raw + list(groups)


class Merger:
    """The syncer's merges of fragments, from the arrivals to the committed version."""

    def __init__(self, context: SyncerContext, fragments: tuple[Fragment, ...], state: SyncerState) -> None:
        self.sync, self.fragments, self.state = context.recipe.sync, fragments, state
        self.home, self.secret, self.clock = context.home, context.secret, context.clock
        self.workspace = MergeWorkspace(resolve_threads(self.sync.merge_threads))
        """The rounds' threads and the buffers they reuse from one round to the next."""

    def compute(self, action: decisions.Merge, inputs: MergeInputs) -> ComputedRound | MergeOutcome:
        """Merge ``action``'s arrivals into its fragment in memory; the outcome at once
        when every arrival was refused (a round of refused payloads makes no version,
        not even a momentum step)."""
        fragment, state, secret = action.fragment, self.state, self.secret
        raw = [arrival for arrival in action.arrivals if arrival.group is None]
        groups: dict[str, list[decisions.Arrival]] = {}
        for arrival in action.arrivals:
            if arrival.group is not None:
                groups.setdefault(arrival.group, []).append(arrival)
        refused: list[Refusal] = []
        raw = self._announced(raw, inputs, refused)
        groups = {group: sends for group, sends in groups.items() if self._aggregate_announced(group, inputs, refused)}
        # retired in the order found: refused by their markers, superseded, refused by the round
        retired = [_qualified(refusal) for refusal in refused] + [arrival.key for arrival in action.superseded]
        if not raw and not groups:
            oldest = state.windows[fragment].oldest_anchorable
            seconds = self.clock() - inputs.started
            log.info("fragment %d: nothing to merge, every arrival was refused", fragment)
            finished = decisions.MergeFinished(
                fragment, state.fragment_versions[fragment], oldest, seconds, frozenset()
            )
            return MergeOutcome(finished, tuple(refused), _payload_ids(retired))
        version, previous_version = Version(state.version + 1), state.fragment_versions[fragment]
        inputs_of = [
            RoundInput(a.learner, a.base_version, a.c_steps, a.c_tokens, _loader(inputs.blobs[a.key])) for a in raw
        ]
        aggregate_inputs = [AggregateInput(group, _loader(inputs.blobs[group])) for group in groups]
        result = merge_round(
            fragment,
            version,
            inputs_of,
            state.fragment_theta(fragment),
            state.windows[fragment],
            state.optimizer,
            state.publisher,
            secret,
            mean_names=self.fragments[fragment].mean_names,
            meta={"time": time.time(), "previous_version": previous_version},
            aggregates=aggregate_inputs,
            workspace=self.workspace,
        )
        merged = [a for a, r in zip(raw, inputs_of) if r in result.merged]
        rejected = [_refusal(raw[inputs_of.index(bad)].key, "payload", error) for bad, error in result.rejected]
        rejected += [_refusal(bad.key, "aggregate", error) for bad, error in result.rejected_aggregates]
        refused += rejected
        retired += [_qualified(refusal) for refusal in rejected]
        merged_groups = [aggregate.key for aggregate in result.merged_aggregates]
        merged += [arrival for group in merged_groups for arrival in groups[group]]
        retired_here = _payload_ids(retired)
        retiring = {**inputs.retiring, **{payload.key: payload for payload in retired_here}}
        return ComputedRound(
            action=action,
            version=version,
            previous_version=previous_version,
            result=result,
            merged=tuple(merged),
            merged_groups=tuple(merged_groups),
            aggregates=tuple(self._merged_aggregate(group, inputs) for group in merged_groups),
            refused=tuple(refused),
            retired=retired_here,
            retiring=retiring,
            unanchored=inputs.unanchored,
            started=inputs.started,
            merge_seconds=self.clock() - inputs.started,
        )

    def commit(
        self, computed: ComputedRound, evaluation: Evaluation | None, timing: decisions.DecisionState
    ) -> MergeOutcome:
        """Commit a computed round (with its held-out loss, when evaluated) to the home
        store: the ledger entry lists what it merged and every payload retired since the
        last commit.  ``timing`` holds the moving averages the commit records (xi_quorum,
        xi_sync).  The outcome says what to publish."""
        state, fragment, version = self.state, computed.action.fragment, computed.version
        evaluation_seconds = self.clock() - computed.started - computed.merge_seconds  # not part of xi_sync
        if state.snapshot_due(version, self.sync.snapshot_every):
            state.note_snapshot(version)
        merged = computed.merged
        record = CommitRecord(
            version=version,
            fragment=fragment,
            previous_version=computed.previous_version,
            merged=tuple(
                MergedPayload(
                    key=a.key,
                    learner=a.learner,
                    sequence=a.sequence,
                    base_version=a.base_version,
                    c_steps=a.c_steps,
                    c_tokens=a.c_tokens,
                    aggregate=a.group,
                )
                for a in merged
            ),
            retired=tuple(
                RetiredPayload(key=p.key, learner=p.learner, fragment=p.fragment, sequence=p.sequence)
                for p in computed.retiring.values()
            ),
            unanchored=computed.unanchored,
            aggregates=computed.aggregates,
            digest=state.digest(fragment),
            time=time.time(),
            seconds=computed.merge_seconds,
            merges=state.merges + 1,
            snapshot_version=state.snapshot_version,
            quorum_seconds=timing.quorum_seconds,
            sync_seconds=timing.sync_seconds,
            evaluation=evaluation,
        )
        keep_after = Version(max(0, state.snapshot_version - self.sync.snapshot_every))
        commit_merge(self.home, state, self.secret, record, computed.result.payload, keep_after)
        consumed = [a.key for a in merged if a.group is None] + list(computed.merged_groups) + list(computed.retiring)
        seconds = self.clock() - computed.started - evaluation_seconds
        learners = sorted({a.learner for a in merged})
        log.info(
            "version %d: fragment %d from %s in %.2f s", version, fragment, ", ".join(learners) or "nobody", seconds
        )
        oldest = state.windows[fragment].oldest_anchorable
        return MergeOutcome(
            decisions.MergeFinished(fragment, version, oldest, seconds, frozenset(a.key for a in merged)),
            computed.refused,
            computed.retired,
            Committed(
                version=version,
                fragment=fragment,
                payload=computed.result.payload,
                consumed=tuple(consumed),
                relays=tuple(name for name in consumed if RELAY_KEY.match(name.split(":", 1)[1])),
                merge=LastMerge(
                    fragment=fragment, version=version, learners=learners, seconds=seconds, time=time.time()
                ),
            ),
        )

    def _merged_aggregate(self, group: str, inputs: MergeInputs) -> MergedAggregate:
        record = inputs.records[group]
        region = group.split(":", 1)[0]
        return MergedAggregate(
            key=group, region=region, serial=record.serial, anchor=record.anchor, made_at=record.made_at
        )

    def _announced(
        self, arrivals: list[decisions.Arrival], inputs: MergeInputs, refused: list[Refusal]
    ) -> list[decisions.Arrival]:
        """The arrivals whose bytes are the payload their marker announced; the others
        are refused (and retired) before anything is merged."""
        kept = []
        for arrival in arrivals:
            try:
                check_announced(inputs.records[arrival.key], inputs.blobs[arrival.key], self.secret)
            except PayloadError as error:
                refused.append(_refusal(arrival.key, "payload", error))
                continue
            kept.append(arrival)
        return kept

    def _aggregate_announced(self, group: str, inputs: MergeInputs, refused: list[Refusal]) -> bool:
        """Whether an aggregate's bytes are the aggregate its marker announced (else it
        is refused and retired whole)."""
        record = inputs.records[group]
        blob = inputs.blobs[group]
        try:
            if blob is None:
                raise CorruptPayload(f"{record.key} vanished before it could be merged")
            meta = read_header(blob, self.secret).meta
            found = (meta.get("fragment"), meta.get("serial"), meta.get("anchor"))
            if found != (record.fragment, record.serial, record.anchor):
                raise CorruptPayload(
                    f"{record.key} holds another aggregate than its marker announced: replayed or moved"
                )
        except PayloadError as error:
            refused.append(_refusal(group, "aggregate", error))
            return False
        return True


def _refusal(name: str, kind: str, error: Exception) -> Refusal:
    region, key = name.split(":", 1)
    return Refusal(region, kind, key, error)


def _qualified(refusal: Refusal) -> str:
    return f"{refusal.region}:{refusal.key}"


def _payload_ids(names: list[str]) -> tuple[PayloadId, ...]:
    """The payloads named, in order (a name that is no payload's, none)."""
    return tuple(payload for payload in map(payload_id, names) if payload is not None)


def _loader(blob: bytes) -> Callable[[], bytes]:
    return lambda: blob
