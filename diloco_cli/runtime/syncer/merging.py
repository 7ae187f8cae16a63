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
from diloco_cli.config.recipe import SyncConfig
from diloco_cli.core import decisions
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.types import Version
from diloco_cli.runtime.syncer.evaluation import Evaluator
from diloco_cli.runtime.syncer.merge_round import RoundInput, merge_round
from diloco_cli.runtime.syncer.observation import Observer
from diloco_cli.runtime.syncer.publication import Publication
from diloco_cli.runtime.syncer.region_scan import payload_id
from diloco_cli.runtime.syncer.state import SyncerState, commit_merge
from diloco_cli.store.documents import LastMerge
from diloco_cli.store.home import CommitRecord, MergedPayload, RetiredPayload, SyncerHome
from diloco_cli.store.region import PayloadRecord

log = logging.getLogger("diloco.syncer")

SAME_SEND = ("learner", "fragment", "base_version", "c_steps", "c_tokens", "step", "sent_at")
"""What a learner writes both into a payload's authenticated header and into its marker."""


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

    def merge(self, action: decisions.Merge, timing: decisions.DecisionState) -> MergeOutcome:
        """Merge ``action``'s arrivals into its fragment; ``timing`` holds the moving
        averages the commit records (xi_quorum, xi_sync)."""
        started = self.clock()
        fragment, state, observer = action.fragment, self.state, self.observer
        blobs = observer.payloads([arrival.key for arrival in action.arrivals])
        if not isinstance(blobs, dict):
            log.warning("merge of fragment %d postponed: %s", fragment, blobs)
            return MergeOutcome(decisions.MergeAborted(fragment))
        arrivals = self._announced(action.arrivals, blobs)
        for arrival in action.superseded:
            observer.retire(payload_id(arrival.key))
        if not arrivals:  # a round of refused payloads makes no version (not even a momentum step)
            oldest = state.windows[fragment].oldest_anchorable
            seconds = self.clock() - started
            log.info("fragment %d: nothing to merge, every arrival was refused", fragment)
            return MergeOutcome(decisions.MergeFinished(fragment, state.fragment_versions[fragment], oldest, seconds))
        version, previous_version = Version(state.version + 1), state.fragment_versions[fragment]
        inputs = [RoundInput(a.learner, a.base_version, a.c_steps, a.c_tokens, _loader(blobs[a.key])) for a in arrivals]
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
        )
        merged = [a for a, r in zip(arrivals, inputs) if r in result.merged]
        for bad, error in result.rejected:
            self._refuse(arrivals[inputs.index(bad)], error)
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
                )
                for a in merged
            ),
            retired=tuple(
                RetiredPayload(key=p.key, learner=p.learner, fragment=p.fragment, sequence=p.sequence)
                for p in retired.values()
            ),
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
        self.publication.publish(version, fragment, result.payload, with_snapshot=state.snapshot_version == version)
        consumed = [a.key for a in merged] + list(retired)
        observer.forget(consumed)
        if self.sync.delete_consumed_payloads:
            observer.delete(consumed)
        seconds = self.clock() - started - evaluation_seconds
        learners = sorted({a.learner for a in merged})
        log.info(
            "version %d: fragment %d from %s in %.2f s", version, fragment, ", ".join(learners) or "nobody", seconds
        )
        return MergeOutcome(
            decisions.MergeFinished(fragment, version, state.windows[fragment].oldest_anchorable, seconds),
            LastMerge(fragment=fragment, version=version, learners=learners, seconds=seconds, time=time.time()),
        )

    def _announced(
        self, arrivals: tuple[decisions.Arrival, ...], blobs: dict[str, bytes | None]
    ) -> list[decisions.Arrival]:
        """The arrivals whose bytes are the payload their marker announced; the others
        are refused and retired before anything is merged."""
        kept = []
        for arrival in arrivals:
            try:
                _check_announced(self.observer.observed[arrival.key], blobs[arrival.key], self.secret)
            except PayloadError as error:
                self._refuse(arrival, error)
                continue
            kept.append(arrival)
        return kept

    def _refuse(self, arrival: decisions.Arrival, error: Exception) -> None:
        region, key = arrival.key.split(":", 1)
        self.observer.refused(region, "payload", key, error)
        self.observer.retire(payload_id(arrival.key))


def _check_announced(record: PayloadRecord, blob: bytes | None, secret: RunSecret) -> None:
    """Raise PayloadError unless ``blob`` is authentic and is the very send its marker
    describes: an authentic older body of the same learner (a replay) differs in its
    step and counters, another run's in its tag."""
    if blob is None:
        raise CorruptPayload(f"{record.key} vanished before it could be merged")
    meta = read_header(blob, secret).meta
    differing = [field for field in SAME_SEND if meta.get(field) != record.meta.get(field)]
    if differing:
        raise CorruptPayload(
            f"{record.key} holds another send than its marker announced ({', '.join(differing)} differ): "
            "replayed or moved"
        )


def _loader(blob: bytes) -> Callable[[], bytes]:
    return lambda: blob
