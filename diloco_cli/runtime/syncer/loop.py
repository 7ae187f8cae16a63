"""The syncer process: observe every region's bucket, decide, merge and publish, keep up.

Each turn (:meth:`Syncer.turn`) reads top to bottom:

1. **observe**: scan every region at once for new payloads (and, every few seconds,
   heartbeats) (:mod:`.observation`);
2. **decide**: fold what was seen into the pure decision state machine
   (:func:`diloco_cli.core.decisions.step`: quorum, grace window, resync, supersede);
3. **act**: carry out its merges (:mod:`.merging`: read, verify, merge, commit, then
   publish), resyncs and discards;
4. **upkeep**: repair published objects learners refused, follow the manifest
   (``diloco scale``, ``diloco chaos``) and the control notes, catch up regions that
   missed a publication, sweep leftovers (:mod:`.leftovers`), end the run when every
   learner is done and nothing is left to merge, write the status (:mod:`.status`).

Killed at any instant, the syncer restarts from its commits (:mod:`.state`) with no
arrival lost and none merged twice.

With syncer shards (``sync.shards: N``) each shard is such a syncer over its own
fragments (``p % N == s``), with its own home, ledger, version numbers and head: it
scans only its fragments' arrivals and publishes under ``global/shard-<s>/``.  Shard 0
also speaks for the run's membership in the control notes, sweeps the regions'
leftovers and evaluates the whole model (:mod:`.evaluation`).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import replace
from typing import Any

from diloco_cli.codec import RunSecret
from diloco_cli.core import decisions
from diloco_cli.core.cadence import END_READ_SECONDS, Cadences, due_to_finish
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.runtime.syncer.build import build_syncer, initial_decisions
from diloco_cli.runtime.syncer.context import syncer_context
from diloco_cli.runtime.syncer.merging import ComputedRound, MergeInputs, MergeOutcome, arrival_keys
from diloco_cli.runtime.syncer.region_scan import missing, payload_id
from diloco_cli.store.documents import Head, SyncerPhase, SyncerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.syncer")

EXIT_FINISHED = 0
EXIT_STOPPED = 143
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
        self.stop_requested = False
        self.finished = False
        self.outcomes: list[decisions.Observation] = []
        """What this syncer's own merges told the decisions, for the next turn."""
        self.given_up: dict[LearnerId, str] = {}
        self.ending: str | None = None
        """Why the run has not ended though every learner is done (for ``diloco status``)."""
        self._held_since: float | None = None
        """Since when only a reducer's report holds up the end (syncer clock)."""
        self.cadences = Cadences("beats", "ending", "status", "sweep")
        """When each periodic task of the loop last ran (syncer clock)."""

    # ----------------------------------------------------------------------- start

    def start(self) -> None:
        """Restore the syncer's state from its home store (:func:`~.build.build_syncer`)
        and bring every region in line with it (what a syncer killed before could not
        publish)."""
        parts = build_syncer(self.spec, self.context, self.head)
        self.fragments, self.state, self.evaluator = parts.fragments, parts.state, parts.evaluator
        self.observer, self.notes, self.publication = parts.observer, parts.notes, parts.publication
        self.merger, self.board, self.sweepers = parts.merger, parts.board, parts.sweepers
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
        """Whether this syncer writes the notes of the run's membership (drain, data
        slices, H under dynamic local updates): the only syncer, or shard 0 of several;
        every shard writes its own resync requests."""
        return self.shard.index == 0

    def head(self) -> Head:
        return self.state.head(self.recipe.sync.snapshot_every, self.finished)

    # ------------------------------------------------------------------------ loop

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self.start()
        try:
            while not self.stop_requested:
                wake = self.turn()
                if self.finished:
                    return EXIT_FINISHED
                time.sleep(max(0.0, wake - self.clock()))
            self.write_status(SyncerPhase.STOPPED)
            return EXIT_STOPPED
        finally:
            self.fanout.close()

    def _request_stop(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after the current merge", signum)
        self.stop_requested = True

    def turn(self, read_heartbeats: bool | None = None) -> float:
        """One turn: observe, decide, act, upkeep; returns when to wake for the next.
        Heartbeats are read every few seconds (more often once a learner is due to
        finish), or when ``read_heartbeats`` says so."""
        now = self.clock()
        sync = self.recipe.sync
        if read_heartbeats is None:
            read_heartbeats = self.cadences.due(
                "beats", now, min(sync.status_seconds, self.recipe.training.heartbeat_seconds)
            ) or (
                due_to_finish(self.observer.heartbeats.values(), time.time())
                and self.cadences.due("ending", now, END_READ_SECONDS)
            )
        look = self.observer.look(self.spec, read_heartbeats, self._published_keys() if read_heartbeats else ())
        for region in look.lost:
            self.publication.mark_behind(region)
        if look.regained:
            self.publication.catch_up_soon()
        for region in look.wiped:
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
        if read_heartbeats and self._over(self.clock()):
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
                self.observer.retire(payload_id(action.arrival.key))
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
        inputs = MergeInputs(blobs, self.observer.observed, dict(self.observer.retiring), started)
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
        """Take in what ``diloco scale`` and ``diloco chaos`` changed in the manifest:
        learners added or drained (M and K follow, and each learner gets its note: drain,
        its slice of the data) and a new chaos plan (the buckets' outage windows)."""
        spec = self.manifest.changed() if self.manifest else None
        if spec is not None and (spec.run, spec.created) != (self.spec.run, self.spec.created):
            log.warning("the manifest now describes another run (%s); ignoring it", spec.run)
            spec = None
        if spec is not None and spec.chaos != self.spec.chaos:
            for name in self.buckets:
                faults = spec.faults_of(name)
                self.buckets[name].store.faults = self.observer.probes[name].store.faults = faults
            self.spec = self.spec.model_copy(update={"chaos": spec.chaos})
            log.info("the run's chaos plan changed: outages are injected as it says from now on")
        if spec is not None and spec.learners != self.spec.learners:
            self._follow_membership(spec)
        down = set(self.observer.reachability.down)
        if self.speaks_for_membership:
            self.notes.follow(self.spec, skip=down)
        if self.recipe.sync.dynamic_local_updates and self.speaks_for_membership:
            live = self.decisions.live_learners(self.clock())
            heartbeats = self.observer.heartbeats
            times = {m: beat.step_seconds for m, beat in heartbeats.items() if m in live and beat.step_seconds}
            self.notes.follow_speeds(self.spec, times, skip=down)
        self.notes.deliver(skip=down)

    def _follow_membership(self, spec: RunSpec) -> None:
        """Learners added or drained: M and K follow."""
        policy = replace(self.decisions.policy, num_learners=len(spec.active_learners), quorum=spec.recipe.quorum)
        self.decisions = replace(self.decisions, policy=policy)
        added = sorted({s.id for s in spec.learners} - {s.id for s in self.spec.learners})
        drained_before = {s.id for s in self.spec.learners if s.drain}
        draining = sorted(s.id for s in spec.learners if s.drain and s.id not in drained_before)
        self.spec = spec
        log.info(
            "the run now has M=%d learners, K=%d%s%s",
            policy.num_learners,
            policy.quorum,
            f"; added {', '.join(added)}" if added else "",
            f"; draining {', '.join(draining)}" if draining else "",
        )

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

    def _over(self, now: float) -> bool:
        """Every learner finished or was given up, and nothing is left to merge: nothing
        observed or in flight, and the last scan of every region that holds a learner
        not given up saw all of it (a scan cut short may have missed a last payload)."""
        end = decisions.run_end(self.decisions, [spec.id for spec in self.spec.learners], now)
        self.given_up = dict(end.given_up)
        rounds = self.decisions.rounds.values()
        idle = self.observer.idle and not self.outcomes and not any(r.pending or r.merging for r in rounds)
        waited_on = {learner.region for learner in self.spec.learners if learner.id not in self.given_up}
        seen_whole = all(self.observer.whole[region] for region in waited_on)
        ended = end.over and idle and seen_whole and self.evaluator.others_finished()
        held = sorted(r for r in waited_on if not self._reducer_done(r))
        self.ending = None
        if not ended or not held:
            self._held_since = None
            return ended
        # every input is in; a reducer that still reports holding something (dead, wiped,
        # or holding what can no longer be merged) is waited for as a learner would be
        self._held_since = now if self._held_since is None else self._held_since
        waited, limit, regions = now - self._held_since, self.recipe.sync.give_up_seconds, ", ".join(held)
        if waited < limit:
            self.ending = (
                f"every learner is done and nothing is left to merge, but the reducer of region {regions} has "
                f"reported sends or aggregates it holds for {waited:.0f} s; the run ends without them after "
                f"sync.give_up_seconds ({limit:.0f} s) (see `diloco logs {self.spec.run} reducer-{held[0]}`)"
            )
            return False
        log.warning("ending without what the reducer of region %s holds: it waited %.0f s for it", regions, waited)
        return True

    def _reducer_done(self, region: str) -> bool:
        """The region's reducer holds nothing (no send waiting, no aggregate in flight)
        and has seen the last heartbeat the syncer has of each of its learners."""
        status = self.observer.reducer_status.get(region)
        if status is None or status.waiting or status.in_flight:
            return False
        beats = self.observer.heartbeats
        learners = [s.id for s in self.spec.learners if s.region == region and s.id not in self.given_up]
        return all(
            learner in beats and status.heartbeats_seen.get(learner) == beats[learner].time for learner in learners
        )

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
