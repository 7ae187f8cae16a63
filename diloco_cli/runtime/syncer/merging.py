"""Carrying out one merge the decisions asked for: read, verify, merge, commit, publish.

The order is what makes a killed syncer lose nothing and merge nothing twice
(docs/protocol.md): the arrivals' bytes are read (from the read-ahead, else now) and
checked to be the very sends their markers announced; the round is computed
(:func:`~.merge_round.merge_round`); the new version is committed to the home store
with its ledger entry, listing the payloads it merged and those retired unmerged since
the last commit (:func:`~.state.commit_merge`); only then is it published to every
region, and the consumed payloads deleted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, read_header
from diloco_cli.codec.parallel import resolve_threads
from diloco_cli.config.recipe import SyncConfig
from diloco_cli.core import decisions
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.types import Version
from diloco_cli.runtime.outer_gradients import check_announced
from diloco_cli.runtime.syncer.evaluation import Evaluator
from diloco_cli.runtime.syncer.merge_round import AggregateInput, RoundInput, merge_round
from diloco_cli.runtime.syncer.observation import Observer
from diloco_cli.runtime.syncer.publication import Publication
from diloco_cli.runtime.syncer.region_scan import payload_id
from diloco_cli.runtime.syncer.state import SyncerState, commit_merge
from diloco_cli.runtime.workspace import MergeWorkspace
from diloco_cli.store.documents import LastMerge
from diloco_cli.store.home import CommitRecord, MergedAggregate, MergedPayload, RetiredPayload, SyncerHome
from diloco_cli.store.region import RELAY_KEY

log = logging.getLogger("diloco.syncer")


@dataclass(frozen=True)
class MergeOutcome:
    """What a merge tells the decisions (finished or aborted), and the merge if one was made."""

    observation: decisions.Observation
    merged: LastMerge | None = None


class Merger:
    """The syncer's merges of fragments, from the arrivals to the published version."""

    def __init__(
        self,
        sync: SyncConfig,
        fragments: tuple[Fragment, ...],
        state: SyncerState,
        home: SyncerHome,
        secret: RunSecret,
        observer: Observer,
        publication: Publication,
        evaluator: Evaluator,
        clock: Callable[[], float],
    ) -> None:
        self.sync, self.fragments, self.state, self.home, self.secret = sync, fragments, state, home, secret
        self.observer, self.publication, self.evaluator, self.clock = observer, publication, evaluator, clock
        self.workspace = MergeWorkspace(resolve_threads(sync.merge_threads))
        """The rounds' threads and the buffers they reuse from one round to the next."""

    def merge(self, action: decisions.Merge, timing: decisions.DecisionState) -> MergeOutcome:
        """Merge ``action``'s arrivals into its fragment; ``timing`` holds the moving
        averages the commit records (xi_quorum, xi_sync)."""
        started = self.clock()
        fragment, state, observer = action.fragment, self.state, self.observer
        raw = [arrival for arrival in action.arrivals if arrival.group is None]
        groups: dict[str, list[decisions.Arrival]] = {}
        for arrival in action.arrivals:
            if arrival.group is not None:
                groups.setdefault(arrival.group, []).append(arrival)
        blobs = observer.payloads([arrival.key for arrival in raw] + list(groups))
        if not isinstance(blobs, dict):
            log.warning("merge of fragment %d postponed: %s", fragment, blobs)
            return MergeOutcome(decisions.MergeAborted(fragment))
        raw = self._announced(raw, blobs)
        groups = {group: sends for group, sends in groups.items() if self._aggregate_announced(group, blobs)}
        for arrival in action.superseded:
            observer.retire(payload_id(arrival.key))
        if not raw and not groups:  # a round of refused payloads makes no version (not even a momentum step)
            oldest = state.windows[fragment].oldest_anchorable
            seconds = self.clock() - started
            log.info("fragment %d: nothing to merge, every arrival was refused", fragment)
            finished = decisions.MergeFinished(
                fragment, state.fragment_versions[fragment], oldest, seconds, frozenset()
            )
            return MergeOutcome(finished)
        version, previous_version = Version(state.version + 1), state.fragment_versions[fragment]
        inputs = [RoundInput(a.learner, a.base_version, a.c_steps, a.c_tokens, _loader(blobs[a.key])) for a in raw]
        aggregate_inputs = [AggregateInput(group, _loader(blobs[group])) for group in groups]
        result = merge_round(
            fragment,
            version,
            inputs,
            state.fragment_theta(fragment),
            state.windows[fragment],
            state.optimizer,
            state.publisher,
            self.secret,
            mean_names=self.fragments[fragment].embedding_names,
            meta={"time": time.time(), "previous_version": previous_version},
            aggregates=aggregate_inputs,
            workspace=self.workspace,
        )
        merged = [a for a, r in zip(raw, inputs) if r in result.merged]
        for bad, error in result.rejected:
            self._refuse(raw[inputs.index(bad)], error)
        for bad, error in result.rejected_aggregates:
            self._refuse_aggregate(bad.key, error)
        merged_groups = [aggregate.key for aggregate in result.merged_aggregates]
        merged += [arrival for group in merged_groups for arrival in groups[group]]
        merge_seconds = self.clock() - started
        evaluation = None
        if self.evaluator.due(version):
            tokens = sum(beat.tokens for beat in observer.heartbeats.values())
            evaluation = self.evaluator.evaluate(state.theta, version, tokens)
        evaluation_seconds = self.clock() - started - merge_seconds  # not part of xi_sync
        if state.snapshot_due(version, self.sync.snapshot_every):
            state.note_snapshot(version)
        retired = observer.take_retiring()
        record = CommitRecord(
            version=version,
            fragment=fragment,
            previous_version=previous_version,
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
                for p in retired.values()
            ),
            aggregates=tuple(self._merged_aggregate(group) for group in merged_groups),
            digest=state.digest(fragment),
            time=time.time(),
            seconds=merge_seconds,
            merges=state.merges + 1,
            snapshot_version=state.snapshot_version,
            quorum_seconds=timing.quorum_seconds,
            sync_seconds=timing.sync_seconds,
            evaluation=evaluation,
        )
        keep_after = Version(max(0, state.snapshot_version - self.sync.snapshot_every))
        commit_merge(self.home, state, self.secret, record, result.payload, keep_after)
        self.publication.publish(version, fragment, result.payload)
        consumed = [a.key for a in merged if a.group is None] + merged_groups + list(retired)
        observer.forget(consumed)
        # relayed copies are the syncer's to delete (their reducer then lets the payload go)
        observer.delete([name for name in consumed if RELAY_KEY.match(name.split(":", 1)[1])])
        seconds = self.clock() - started - evaluation_seconds
        learners = sorted({a.learner for a in merged})
        log.info(
            "version %d: fragment %d from %s in %.2f s", version, fragment, ", ".join(learners) or "nobody", seconds
        )
        oldest = state.windows[fragment].oldest_anchorable
        return MergeOutcome(
            decisions.MergeFinished(fragment, version, oldest, seconds, frozenset(a.key for a in merged)),
            LastMerge(fragment=fragment, version=version, learners=learners, seconds=seconds, time=time.time()),
        )

    def _merged_aggregate(self, group: str) -> MergedAggregate:
        record = self.observer.observed[group]
        region = group.split(":", 1)[0]
        return MergedAggregate(
            key=group, region=region, serial=record.serial, anchor=record.anchor, made_at=record.made_at
        )

    def _announced(self, arrivals: list[decisions.Arrival], blobs: dict[str, bytes | None]) -> list[decisions.Arrival]:
        """The arrivals whose bytes are the payload their marker announced; the others
        are refused and retired before anything is merged."""
        kept = []
        for arrival in arrivals:
            try:
                check_announced(self.observer.observed[arrival.key], blobs[arrival.key], self.secret)
            except PayloadError as error:
                self._refuse(arrival, error)
                continue
            kept.append(arrival)
        return kept

    def _aggregate_announced(self, group: str, blobs: dict[str, bytes | None]) -> bool:
        """Whether an aggregate's bytes are the aggregate its marker announced (else it
        is refused and retired whole)."""
        record = self.observer.observed[group]
        blob = blobs[group]
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
            self._refuse_aggregate(group, error)
            return False
        return True

    def _refuse(self, arrival: decisions.Arrival, error: Exception) -> None:
        region, key = arrival.key.split(":", 1)
        self.observer.refused(region, "payload", key, error)
        self.observer.retire(payload_id(arrival.key))

    def _refuse_aggregate(self, group: str, error: Exception) -> None:
        region, key = group.split(":", 1)
        self.observer.refused(region, "aggregate", key, error)
        self.observer.retire(payload_id(group))


def _loader(blob: bytes) -> Callable[[], bytes]:
    return lambda: blob
