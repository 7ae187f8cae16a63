"""The syncer process: observe every region's bucket, decide, merge and publish, keep up.

Each turn (:meth:`Syncer.turn`) reads top to bottom:

1. **observe**: scan every region at once for new payloads (and, every few seconds,
   heartbeats) (:mod:`.observation`);
2. **decide**: fold what was seen into the pure decision state machine
   (:func:`diloco_cli.core.decisions.step`: quorum, grace window, resync, supersede);
3. **act**: carry out its merges (:mod:`.merging`: read, verify, merge, commit; each
   returns an outcome the loop applies: publish, let go), resyncs and discards;
4. **upkeep**: repair published objects learners refused, follow the manifest
   (``diloco scale``, ``diloco chaos``: :mod:`.following`) and the control notes, catch
   up regions that missed a publication, sweep leftovers (:mod:`.leftovers`), end the
   run when every learner is done and nothing is left to merge (:mod:`.ending`), write
   the status (:mod:`.status`).

Killed at any instant, the syncer restarts from its commits (:mod:`.state`) with no
arrival lost and none merged twice; its collaborators are built in one function from
the run spec (:mod:`.build`).

With syncer shards (``sync.shards: N``) each shard is such a syncer over its own
fragments (``p % N == s``), with its own home, ledger, version numbers and head: it
scans only its fragments' arrivals and publishes under ``global/shard-<s>/``.  Shard 0
also speaks for the run's membership in the control notes, sweeps the regions'
leftovers and evaluates the whole model (:mod:`.evaluation`).
"""

from __future__ import annotations

import logging
import time

from diloco_cli.codec import RunSecret
from diloco_cli.core import decisions
from diloco_cli.core.cadence import Cadences
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.coordinator import EXIT_STOPPED, StopSignals, heartbeats_due, run_turns
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.runtime.syncer.build import build_syncer, initial_decisions
from diloco_cli.runtime.syncer.context import syncer_context
from diloco_cli.runtime.syncer.merging import ComputedRound, MergeInputs, MergeOutcome, arrival_keys
from diloco_cli.runtime.syncer.region_scan import missing, payload_id
from diloco_cli.store.documents import Head, SyncerPhase, SyncerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.syncer")

REPORTED_REFUSALS_SECONDS = 60.0
"""Refusals learners reported up to this long before the syncer started are checked too."""


class Syncer:
    """The syncer of one run (its shard ``syncer_shard``, in a run of several):
    :meth:`start` once, then :meth:`turn` until it finishes (:meth:`run` does both, and
    stops on SIGTERM or SIGINT)."""

    def __init__(
        self,
        spec: RunSpec,
        secret: RunSecret,
        clock=time.monotonic,
        manifest: ManifestWatch | None = None,
        syncer_shard: int = 0,
    ) -> None:
        self.context = syncer_context(spec, secret, syncer_shard, clock)
        self.spec = spec
        self.manifest = manifest
        """The run's manifest, followed for learners added or drained (``diloco scale``)."""
        self.shard, self.buckets, self.home = self.context.shard, self.context.buckets, self.context.home
        self.recipe, self.clock = spec.recipe, clock
        """The recipe and clock the loop's own cadences follow (its collaborators' are the context's)."""
        self.finished = False
        self.outcomes: list[decisions.Observation] = []
        """What this syncer's own merges told the decisions, for the next turn."""
        self.cadences = Cadences("beats", "ending", "status", "sweep")
        """When each periodic task of the loop last ran (syncer clock)."""

    # ----------------------------------------------------------------------- start

    def start(self) -> None:
        """Restore the syncer's state from its home store (:func:`~.build.build_syncer`)
        and bring every region in line with it (what a syncer killed before could not
        publish)."""
        parts = build_syncer(self.spec, self.context, self.head, self.manifest)
        self.fragments, self.state, self.evaluator = parts.fragments, parts.state, parts.evaluator
        self.observer, self.notes, self.publication = parts.observer, parts.notes, parts.publication
        self.merger, self.board, self.sweepers = parts.merger, parts.board, parts.sweepers
        self.follower, self.run_end = parts.follower, parts.run_end
        self.fanout = self.context.fanout
        self.decisions = initial_decisions(self.spec, self.state, len(self.fragments), self.clock())
        self.board.continue_counts()
        if self.speaks_for_membership:
            self.notes.follow(self.spec)  # a restarted syncer delivers what it may not have
        self.publication.catch_up(set(self.buckets) - self._wiped())  # those are restored at the first look

    def _wiped(self) -> set[str]:
        """Regions that lost what the syncer published (their bucket wiped, perhaps while
        this syncer was down); none before the first merge (a head is all there is)."""
        wiped: set[str] = set()
        if self.state.version == 0:
            return wiped
        for name, bucket in self.buckets.items():
            try:
                if missing(bucket, self._published_keys()):
                    wiped.add(name)
            except StorageError as error:
                log.warning("region %s cannot be checked now (caught up later): %s", name, error)
        return wiped

    @property
    def speaks_for_membership(self) -> bool:
        """Whether this syncer writes the notes of the run's membership (the only
        syncer, or shard 0 of several: see :class:`~.following.ManifestFollower`)."""
        return self.shard.index == 0

    @property
    def given_up(self) -> dict[LearnerId, str]:
        """The learners the run ends without, and why (:class:`~.ending.RunEnd`)."""
        return self.run_end.given_up

    @property
    def ending(self) -> str | None:
        """Why the run has not ended though every learner is done (:class:`~.ending.RunEnd`)."""
        return self.run_end.ending

    def head(self) -> Head:
        return self.state.head(self.recipe.sync.snapshot_every, self.finished)

    # ------------------------------------------------------------------------ loop

    def run(self) -> int:
        stop = StopSignals("the current merge", log)
        self.start()
        try:
            code = run_turns([self], self.clock, stop)
            if code == EXIT_STOPPED:
                self.write_status(SyncerPhase.STOPPED)
            return code
        finally:
            self.fanout.close()

    def turn(self, read_heartbeats: bool | None = None) -> float:
        """One turn: observe, decide, act, upkeep; returns when to wake for the next.
        Heartbeats are read every few seconds (more often once a learner is due to
        finish), or when ``read_heartbeats`` says so."""
        now = self.clock()
        sync = self.recipe.sync
        if read_heartbeats is None:
            every = min(sync.status_seconds, self.recipe.training.heartbeat_seconds)
            read_heartbeats = heartbeats_due(self.cadences, now, every, self.observer.heartbeats.values())
        look = self.observer.look(self.spec, read_heartbeats, self._published_keys() if read_heartbeats else ())
        for region in look.lost:
            self.publication.mark_behind(region)
        if look.regained:
            self.publication.catch_up_soon()
        for region in look.wiped:
            self.observer.heard.lose_starts(learner.id for learner in self.spec.learners if learner.region == region)
            self._restore(region)
        observations, self.outcomes = self.outcomes + look.observations, []
        self.decisions, actions = decisions.step(self.decisions, observations, now)
        wake = self._act(actions, now)
        if read_heartbeats:
            self._repair_from_reports()
            self._follow_manifest()
        self.publication.catch_up_if_due(now, set(self.observer.reachability.down))
        if self.cadences.due("sweep", now, max(1.0, sync.leftover_seconds / 4)):
            self.sweep(now)
        if read_heartbeats and self.run_end.over(self.spec, self.decisions, bool(self.outcomes), self.clock()):
            self._finish()
        elif self.cadences.due("status", self.clock(), sync.status_seconds):
            self.write_status(SyncerPhase.RUNNING)
        return wake

    def _act(self, actions: list[decisions.Action], now: float) -> float:
        """Carry out the decisions' actions; returns when to decide again."""
        wake = now + self.recipe.sync.poll_seconds
        for action in actions:
            if isinstance(action, decisions.Merge):
                outcome = self._merge(action)
                self.outcomes.append(outcome.observation)
                if outcome.merged is not None:
                    self.board.merged(outcome.merged)
                self.board.reasons[action.fragment] = action.reason
                wake = now
            elif isinstance(action, decisions.Resync):
                region = self.spec.learner(action.learner).region
                self.notes.resync(action.learner, region, action.fragment, action.reason)
                self.observer.refuse_unanchored(action.arrival)
                log.info("told %s to resync: %s", action.learner, action.reason)
            elif isinstance(action, decisions.Discard):
                discarded = action.arrival.group or action.arrival.key
                log.info("discarding %s: %s", discarded, action.reason)
                self.observer.retire(payload_id(discarded))
            elif isinstance(action, decisions.Wait):
                self.board.reasons[action.fragment] = action.reason
                if action.until is not None:
                    wake = min(wake, action.until)
        return wake

    def _merge(self, action: decisions.Merge) -> MergeOutcome:
        """One merge: its arrivals' bytes read (the read-ahead, else now), the round
        computed, evaluated when due, committed; then its outcome applied."""
        started = self.clock()
        blobs = self.observer.payloads(arrival_keys(action))
        if not isinstance(blobs, dict):
            log.warning("merge of fragment %d postponed: %s", action.fragment, blobs)
            return MergeOutcome(decisions.MergeAborted(action.fragment))
        inputs = MergeInputs(
            blobs,
            self.observer.observed,
            dict(self.observer.retiring),
            tuple(self.observer.unanchored.values()),
            started,
        )
        outcome = self.merger.compute(action, inputs)
        if isinstance(outcome, ComputedRound):
            evaluation = None
            if self.evaluator.due(outcome.version):  # recorded with the commit
                tokens = sum(beat.tokens for beat in self.observer.heartbeats.values())
                evaluation = self.evaluator.evaluate(self.state.theta, outcome.version, tokens)
            outcome = self.merger.commit(outcome, evaluation, self.decisions)
        self._apply_merge(outcome)
        return outcome

    def _apply_merge(self, outcome: MergeOutcome) -> None:
        """What a merge did, in the ledger's order: its refusals recorded and its
        retired payloads let go; when it committed a version (listing them), the version
        published, and only then its payloads forgotten and its relays deleted."""
        for refusal in outcome.refused:
            self.observer.refused(refusal.region, refusal.kind, refusal.key, refusal.error)
        for payload in outcome.retired:
            self.observer.retire(payload)
        committed = outcome.committed
        if committed is None:  # the retired wait for the next commit's record
            return
        self.observer.take_retiring()  # the commit listed them
        self.publication.publish(committed.version, committed.fragment, committed.payload)
        self.observer.forget(list(committed.consumed))
        self.observer.delete(list(committed.relays))

    # ---------------------------------------------------------------------- upkeep

    def _repair_from_reports(self) -> None:
        """Check the published objects learners and reducers reported refusing; rewrite
        damaged ones.  A region whose reducer cannot catch up from the updates it holds
        gets a snapshot."""
        reports = [(beat.region, learner, beat.refusals) for learner, beat in self.observer.heartbeats.items()]
        reducers = self.observer.reducer_status
        reports += [(region, f"reducer-{region}", status.refusals) for region, status in reducers.items()]
        for region, reporter, refusals in reports:
            for note in refusals.recent:
                recent = note.time >= self.board.started_at - REPORTED_REFUSALS_SECONDS
                if note.kind in ("update", "snapshot", "head") and recent:
                    self.publication.repair(region, note, reporter)
        for region, status in reducers.items():
            if status.needs_snapshot and not self.observer.is_down(region):
                self.publication.give_snapshot(region, self.clock())

    def _published_keys(self) -> list[str]:
        """What every region that is not behind holds while the syncer's publications
        stand: its head, and the oldest update the head lists (a publication after a wipe
        writes the head again, never the updates before it)."""
        layout, head = next(iter(self.buckets.values())).layout, self.head()
        oldest = [layout.update_key(*head.recent[0])] if head.recent else []
        return [layout.head_key, *oldest]

    def _restore(self, region: str) -> None:
        """A region that lost what the syncer published (its bucket wiped and recreated)
        gets back what its learners and reducer need to go on: the present, and the
        updates after the oldest base any of them is known to hold (from their last
        heartbeats and status)."""
        if self.state.version == 0:  # the region builds version 0 itself: the head is all it lost
            self.publication.catch_up({region})
            return
        bases: dict[FragmentIndex, list[Version]] = {}
        for beat in self.observer.heartbeats.values():
            if beat.region == region:
                for fragment, version in beat.base_versions.items():
                    bases.setdefault(fragment, []).append(version)
        if reducer := self.observer.reducer_status.get(region):
            for fragment, version in reducer.fragment_versions.items():
                bases.setdefault(fragment, []).append(version)
        windows = {fragment: window.versions for fragment, window in self.state.windows.items()}
        self.publication.restore(region, decisions.updates_to_restore(windows, self.head().recent, bases))

    def _follow_manifest(self) -> None:
        """Take in what ``diloco scale`` and ``diloco chaos`` changed in the manifest
        (:class:`~.following.ManifestFollower`): M and K follow, each learner gets its note."""
        self.spec, self.decisions = self.follower.follow(self.spec, self.decisions, self.clock())

    def sweep(self, now: float, all_of_them: bool = False) -> None:
        """Remove leftovers seen long enough (with ``all_of_them``, every one now)."""
        for name, sweeper in self.sweepers.items():
            if self.observer.is_down(name):
                continue
            try:
                sweeper.sweep(now, all_of_them)
            except StorageError as error:
                log.warning("could not sweep %s: %s", sweeper.store.root, error)

    def status(self, phase: SyncerPhase) -> SyncerStatus:
        """The syncer's status document as of now."""
        return self.board.status(phase, self.clock(), self.spec, self.decisions, self.given_up, self.ending)

    def write_status(self, phase: SyncerPhase) -> None:
        """The status to every region that can be reached now."""
        self.board.write(self.status(phase))

    # ---------------------------------------------------------------------- ending

    def _finish(self) -> None:
        state = self.state
        evaluated = state.evaluations and state.evaluations[-1].version == state.version
        if self.evaluator.enabled and (self.shard.sharded or not evaluated):  # shards: the others moved on since
            tokens = sum(beat.tokens for beat in self.observer.heartbeats.values())
            evaluation = self.evaluator.evaluate(state.theta, state.version, tokens)
            if evaluation is not None:
                state.evaluations.append(evaluation)
        self.finished = True
        self.publication.catch_up(set(self.buckets))
        self.sweep(self.clock(), all_of_them=True)  # every learner is done: nothing is in flight
        self.write_status(SyncerPhase.FINISHED)
        without = ", ".join(f"{m} ({why})" for m, why in sorted(self.given_up.items()))
        log.info("finished at version %d%s", state.version, f" without {without}" if without else "")
