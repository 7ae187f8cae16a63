"""The syncer process: poll every region's bucket, decide, merge, commit, publish.

Each loop lists the buckets for new marked payloads (their markers verified), reads the
heartbeats, and feeds both to the pure decision state machine
(:mod:`diloco_cli.core.decisions`).  A merge reads its payloads, is computed by
:func:`~diloco_cli.runtime.merge_round.merge_round`, committed to the home store with
its ledger entry (and, every few versions, the held-out loss), and only then published
to every region (:mod:`diloco_cli.runtime.publication`).  Killed at any instant, the
syncer restarts from its commits with no arrival lost and none merged twice.  Along the
way it rewrites published objects learners report damaged, catches up regions that
missed a publication, and sweeps leftovers (:mod:`diloco_cli.runtime.leftovers`).
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, read_header
from diloco_cli.codec.exact import ExactPublisher
from diloco_cli.core import decisions
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.core.ledger import PayloadId
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.data.learner import heldout_batches
from diloco_cli.runtime.fanout import FanOut
from diloco_cli.runtime.global_weights import encode_snapshot
from diloco_cli.runtime.leftovers import LeftoverSweeper
from diloco_cli.runtime.membership import ControlNotes, ManifestWatch
from diloco_cli.runtime.merge_round import RoundInput, merge_round
from diloco_cli.runtime.publication import Publication
from diloco_cli.runtime.reachability import Reachability
from diloco_cli.runtime.region_scan import RegionScan, payload_id, qualified, scan_region
from diloco_cli.runtime.syncer_state import SyncerState, commit_merge, restore_state
from diloco_cli.store.documents import Evaluation, Head, Heartbeat, LastMerge, Refusals, SyncerPhase, SyncerStatus
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import CommitRecord, MergedPayload, RetiredPayload
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.region import PayloadRecord, RegionBucket, heartbeat_key
from diloco_cli.store.retry import RetryPolicy
from diloco_cli.store.run_spec import RunSpec
from diloco_cli.training.inner import evaluate, resolve_loss

log = logging.getLogger("diloco.syncer")

EXIT_FINISHED = 0
EXIT_STOPPED = 143
CATCH_UP_SECONDS = 5.0
HOME = "home"
"""The syncer's home among its sweepers (the others are keyed by region)."""
"""How often regions that missed a publication are tried again."""


class Syncer:
    def __init__(
        self, spec: RunSpec, secret: RunSecret, clock=time.monotonic, manifest: ManifestWatch | None = None
    ) -> None:
        self.spec = spec
        self.manifest = manifest
        """The run's manifest, followed for learners added or drained (``diloco scale``)."""
        self.recipe = spec.recipe
        self.secret = secret
        self.clock = clock
        self.stop_requested = False
        self.buckets = {bucket.name: bucket for bucket in spec.buckets(secret)}
        self.home = spec.home(secret)
        self.observed: dict[str, PayloadRecord] = {}
        self.prefetched: dict[str, bytes] = {}
        """Bytes of observed payloads, read as soon as their marker was seen: over a WAN
        the download overlaps the wait for a quorum instead of delaying the merge."""
        self.retiring: dict[str, PayloadId] = {}
        """Payloads consumed unmerged since the last commit (its record will list them)."""
        self.pending_observations: list[decisions.Observation] = []
        self.heartbeats: dict[LearnerId, Heartbeat] = {}
        self.refusals = {name: Refusals() for name in self.buckets}
        self.reasons: dict[FragmentIndex, str] = {}
        self.merge_times: deque[float] = deque(maxlen=50)
        self.last_merge: LastMerge | None = None
        self.notes = ControlNotes(self.buckets, self._refused)
        self.given_up: dict[LearnerId, str] = {}
        self.finished = False
        self.started_at = time.time()
        self._last = {
            "beats": float("-inf"),
            "status": float("-inf"),
            "catch_up": float("-inf"),
            "sweep": float("-inf"),
        }
        """When each periodic task of the loop last ran (syncer clock)."""

    # ----------------------------------------------------------------------- setup

    def _setup(self) -> None:
        recipe = self.recipe
        torch.manual_seed(recipe.training.seed)
        self.model = recipe.model.build()
        self.fragments = fragments_of_model(self.model, recipe.sync.num_fragments)
        initial = {name: p.detach() for name, p in self.model.named_parameters()}
        optimizer = NesterovOuterOptimizer(recipe.outer_learning_rate, recipe.sync.outer_momentum)
        publisher = ExactPublisher(recipe.sync.update_codec, self.secret)
        self.heldout = heldout_batches(recipe)
        self.loss_fn = resolve_loss(recipe.training.loss)
        self.state: SyncerState = restore_state(
            self.home,
            self.secret,
            self.fragments,
            initial,
            optimizer,
            publisher,
            recipe.sync.window_versions,
            self._evaluate,
        )
        self.digests = {f.index: self.state.digest(f.index) for f in self.fragments}
        policy = decisions.DecisionPolicy(
            num_learners=len(self.spec.active_learners),
            quorum=recipe.quorum,
            num_fragments=len(self.fragments),
            grace_gamma=recipe.sync.grace_gamma,
            overlap_steps=recipe.sync.overlap_steps,
            max_grace_seconds=recipe.sync.max_grace_seconds,
            liveness_timeout_seconds=recipe.sync.liveness_timeout_seconds,
            give_up_seconds=recipe.sync.give_up_seconds,
        )
        versions = {
            f.index: (self.state.fragment_versions[f.index], self.state.windows[f.index].oldest_anchorable)
            for f in self.fragments
        }
        fresh = decisions.initial_state(policy, self.clock(), versions)
        self.decisions = decisions.DecisionState(
            policy=policy,
            rounds=fresh.rounds,
            started_at=fresh.started_at,
            merged_sequence=dict(self.state.ledger.merged),
            quorum_seconds=self.state.quorum_seconds,
            sync_seconds=self.state.sync_seconds,
        )
        self.fanout = FanOut(len(self.buckets))
        self.publication = Publication(self.buckets, self.home, self.secret, self.fanout)
        after = recipe.sync.leftover_seconds
        self.sweepers = {name: LeftoverSweeper(bucket.store, after) for name, bucket in self.buckets.items()}
        self.sweepers[HOME] = LeftoverSweeper(self.home.store, after, only_partial=True)
        self.reachability = Reachability()
        self.probes = {
            name: self.spec.bucket(name, self.secret, retry=RetryPolicy(attempts=1)) for name in self.buckets
        }
        """Each region's bucket with a single try per call: how an unreachable region is probed."""
        self._continue_counts()
        self.notes.follow(self.spec)  # a restarted syncer delivers what it may not have
        self.publication.catch_up(set(self.buckets), self._head(), self._snapshot_payload)

    def _continue_counts(self) -> None:
        """Storage counts of the syncer's earlier starts, from its newest status in any
        region, so that a restart continues them."""
        self.storage_before: dict[str, StorageCounters] = {}
        self.home_storage_before = StorageCounters()
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

    def _head(self) -> Head:
        snapshot_every = self.recipe.sync.snapshot_every
        recent_from = Version(max(0, self.state.snapshot_version - snapshot_every))
        return Head(
            version=self.state.version,
            fragment_versions=dict(self.state.fragment_versions),
            fragment_digests=dict(self.digests),
            snapshot_version=self.state.snapshot_version,
            recent=self.state.recent_commits(recent_from),
            recent_from=recent_from,
            finished=self.finished,
        )

    def _snapshot_payload(self) -> bytes:
        return encode_snapshot(self.state.theta, self.secret, self.state.version, self.state.fragment_versions)

    def _fresh_snapshot(self) -> None:
        """A snapshot of the present to every region (repairing a damaged one)."""
        self.state.snapshot_version = self.state.version
        payload, head = self._snapshot_payload(), self._head()
        for name, bucket in self.buckets.items():
            try:
                bucket.write_snapshot(head.snapshot_version, payload, replace=True)
                bucket.write_head(head)
            except StorageError:
                self.publication.behind.add(name)

    # ---------------------------------------------------------------- observations

    def _refused(self, region: str, kind: str, key: str, error: Exception) -> None:
        log.warning("refusing %s %s in region %s: %s", kind, key, region, error)
        self.refusals[region].record(kind, key, str(error), time.time())

    def _observe(self, read_heartbeats: bool) -> list[decisions.Observation]:
        """What every region's bucket shows now: its bytes read in every region at once,
        then taken in here, region by region."""
        observations, self.pending_observations = self.pending_observations, []

        def scan(region: str) -> RegionScan:
            learners = [spec.id for spec in self.spec.learners if spec.region == region] if read_heartbeats else []
            bucket = self.probes[region] if self.reachability.is_down(region) else self.buckets[region]
            return scan_region(
                bucket,
                learners,
                known=lambda name: name in self.observed or name in self.retiring,
                consumed=lambda name: self.state.ledger.consumed(payload_id(name)),
                delete_consumed=self.recipe.sync.delete_consumed_payloads,
            )

        now = self.clock()
        regions = [
            name
            for name in self.buckets
            if not self.reachability.is_down(name) or self.reachability.due_for_probe(name, now)
        ]
        scans = self.fanout.each(scan, regions)
        for scan in scans:
            if self._unreachable(scan):
                continue
            observations += self._arrivals(scan)
            observations += self._heartbeats_seen(scan)
        return observations

    def _unreachable(self, scan: RegionScan) -> bool:
        """Track whether a region can be reached: one that cannot is skipped until a
        probe reaches it, and is caught up (everything published meanwhile) after."""
        if scan.unreachable is not None:
            if not self.reachability.is_down(scan.region):
                log.warning(
                    "region %s is unreachable: skipping it until a probe reaches it (%s)", scan.region, scan.unreachable
                )
            self.reachability.failed(scan.region, scan.unreachable, self.clock())
            self.publication.behind.add(scan.region)
            return True
        since = self.reachability.reached(scan.region)
        if since is not None:
            log.info("region %s is reachable again after %.0f s; catching it up", scan.region, self.clock() - since)
            self._last["catch_up"] = float("-inf")
        return False

    def _reachable(self) -> list[str]:
        return [name for name in self.buckets if not self.reachability.is_down(name)]

    def _arrivals(self, scan: RegionScan) -> list[decisions.Observation]:
        for key, error in scan.refused:
            self._refused(scan.region, "marker", key, error)
            self._retire(payload_id(qualified(scan.region, key)))
        found: list[decisions.Observation] = []
        for record in scan.records:
            name = qualified(scan.region, record.key)
            self.observed[name] = record
            if record.key in scan.payloads:
                self.prefetched[name] = scan.payloads[record.key]
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

    def _heartbeats_seen(self, scan: RegionScan) -> list[decisions.Observation]:
        found = []
        for learner, beat in scan.heartbeats:
            if isinstance(beat, PayloadError):
                self._refused(scan.region, "heartbeat", heartbeat_key(learner), beat)
                continue
            if beat is None:
                continue
            previous = self.heartbeats.get(learner)
            self.heartbeats[learner] = beat
            if previous is None or previous.time != beat.time:
                found.append(decisions.HeartbeatSeen(learner, beat.step_seconds, beat.state.value))
        return found

    # ---------------------------------------------------------------------- merges

    def _bucket_and_key(self, name: str) -> tuple[RegionBucket, str]:
        region, key = name.split(":", 1)
        return self.buckets[region], key

    def _read_payloads(self, action: decisions.Merge) -> dict[str, bytes | None] | None:
        """Every arrival's bytes (None for one that vanished), or None when a bucket
        cannot be read now: the merge waits rather than drop an arrival.  Read all at
        once: arrivals come from several regions."""

        def read(name: str) -> bytes | StorageError | None:
            bucket, key = self._bucket_and_key(name)
            try:
                return bucket.read_payload(key)
            except FileNotFoundError:
                return None
            except StorageError as error:
                return error

        names = [arrival.key for arrival in action.arrivals]
        missing = [name for name in names if name not in self.prefetched]
        blobs = {
            **dict(zip(missing, self.fanout.each(read, missing))),
            **{name: self.prefetched[name] for name in names if name in self.prefetched},
        }
        for blob in blobs.values():
            if isinstance(blob, StorageError):
                log.warning("merge of fragment %d postponed: %s", action.fragment, blob)
                return None
        return blobs

    def _merge(self, action: decisions.Merge) -> None:
        started = self.clock()
        fragment, state = action.fragment, self.state
        blobs = self._read_payloads(action)
        if blobs is None:
            self.pending_observations.append(decisions.MergeAborted(fragment))
            return
        arrivals = self._announced(action.arrivals, blobs)
        if not arrivals:  # a round of refused payloads makes no version (not even a momentum step)
            for arrival in action.superseded:
                self._retire(payload_id(arrival.key))
            oldest = state.windows[fragment].oldest_anchorable
            self.pending_observations.append(
                decisions.MergeFinished(fragment, state.fragment_versions[fragment], oldest, self.clock() - started)
            )
            log.info("fragment %d: nothing to merge, every arrival was refused", fragment)
            return
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
            arrival = arrivals[inputs.index(bad)]
            self._refused(arrival.key.split(":", 1)[0], "payload", arrival.key.split(":", 1)[1], error)
            self._retire(payload_id(arrival.key))
        for arrival in action.superseded:
            self._retire(payload_id(arrival.key))
        merge_seconds = self.clock() - started
        evaluation = self._evaluate(state.theta, version) if version % self.recipe.sync.evaluate_every == 0 else None
        evaluation_seconds = self.clock() - started - merge_seconds  # not part of xi_sync
        if version - state.snapshot_version >= self.recipe.sync.snapshot_every:
            state.snapshot_version = version
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
                for p in self.retiring.values()
            ),
            digest=state.digest(fragment),
            time=time.time(),
            seconds=merge_seconds,
            merges=state.merges + 1,
            snapshot_version=state.snapshot_version,
            quorum_seconds=self.decisions.quorum_seconds,
            sync_seconds=self.decisions.sync_seconds,
            evaluation=evaluation,
        )
        keep_after = Version(max(0, state.snapshot_version - self.recipe.sync.snapshot_every))
        commit_merge(self.home, state, self.secret, record, result.payload, keep_after)
        self.digests[fragment] = record.digest
        snapshot = self._snapshot_payload() if state.snapshot_version == version else None
        self.publication.publish(version, fragment, result.payload, snapshot, self._head())
        consumed = [a.key for a in merged] + list(self.retiring)
        self.retiring = {}
        for name in consumed:
            self.observed.pop(name, None)
            self.prefetched.pop(name, None)
        if self.recipe.sync.delete_consumed_payloads:
            self.fanout.each(self._delete_payload, consumed)
        seconds = self.clock() - started - evaluation_seconds
        self.merge_times.append(time.time())
        self.last_merge = LastMerge(
            fragment=fragment,
            version=version,
            learners=sorted({a.learner for a in merged}),
            seconds=seconds,
            time=time.time(),
        )
        self.pending_observations.append(
            decisions.MergeFinished(fragment, version, state.windows[fragment].oldest_anchorable, seconds)
        )
        log.info(
            "version %d: fragment %d from %s in %.2f s",
            version,
            fragment,
            ", ".join(self.last_merge.learners) or "nobody",
            seconds,
        )

    def _announced(
        self, arrivals: tuple[decisions.Arrival, ...], blobs: dict[str, bytes | None]
    ) -> list[decisions.Arrival]:
        """The arrivals whose bytes are the payload their marker announced; the others
        are refused and retired before anything is merged."""
        kept = []
        for arrival in arrivals:
            try:
                _check_announced(self.observed[arrival.key], blobs[arrival.key], self.secret)
            except PayloadError as error:
                self._refused(arrival.key.split(":", 1)[0], "payload", arrival.key.split(":", 1)[1], error)
                self._retire(payload_id(arrival.key))
                continue
            kept.append(arrival)
        return kept

    def _delete_payload(self, name: str) -> None:
        bucket, key = self._bucket_and_key(name)
        try:
            bucket.delete_payload(key)
        except StorageError as error:  # consumed per the ledger: deleted when seen again
            log.warning("could not delete %s: %s", name, error)

    def _resync(self, action: decisions.Resync) -> None:
        self.notes.resync(action.learner, self.spec.learner(action.learner).region, action.fragment, action.reason)
        self._retire(payload_id(action.arrival.key))
        log.info("told %s to resync: %s", action.learner, action.reason)

    def _retire(self, payload: PayloadId) -> None:
        """A payload consumed without a merge: the next commit's record lists it, and it
        is deleted once that record is durable."""
        self.retiring[payload.key] = payload
        self.observed.pop(payload.key, None)
        self.prefetched.pop(payload.key, None)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, theta: Mapping[str, torch.Tensor], version: Version) -> Evaluation:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(theta[name])
        loss = evaluate(self.model, self.heldout, self.loss_fn)
        tokens = sum(beat.tokens for beat in self.heartbeats.values())
        log.info("version %d: held-out loss %.4f", version, loss)
        return Evaluation(version=version, loss=loss, tokens=tokens, time=time.time())

    # ------------------------------------------------------------------ upkeep

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
                self.buckets[name].store.faults = self.probes[name].store.faults = spec.faults_of(name)
            self.spec = self.spec.model_copy(update={"chaos": spec.chaos})
            log.info("the run's chaos plan changed: outages are injected as it says from now on")
        if spec is not None and spec.learners != self.spec.learners:
            policy = replace(self.decisions.policy, num_learners=len(spec.active_learners), quorum=spec.recipe.quorum)
            self.decisions = replace(self.decisions, policy=policy)
            added = sorted(set(s.id for s in spec.learners) - set(s.id for s in self.spec.learners))
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
        down = set(self.reachability.down)
        self.notes.follow(self.spec, skip=down)
        if self.recipe.sync.dynamic_local_updates:
            live = self.decisions.live_learners(self.clock())
            times = {m: beat.step_seconds for m, beat in self.heartbeats.items() if m in live and beat.step_seconds}
            self.notes.follow_speeds(self.spec, times, skip=down)
        self.notes.deliver(skip=down)

    def _repair_from_reports(self) -> None:
        """Check the published objects learners reported refusing; rewrite damaged ones."""
        head = self._head()
        for learner, beat in self.heartbeats.items():
            for note in beat.refusals.recent:
                if note.kind in ("update", "snapshot", "head") and note.time >= self.started_at - 60:
                    self.publication.repair(beat.region, note, learner, head, self._fresh_snapshot)

    # ---------------------------------------------------------------------- status

    def _status(self, phase: SyncerPhase, now: float) -> SyncerStatus:
        recent = [t for t in self.merge_times if t > time.time() - 60]
        return SyncerStatus(
            state=phase,
            run=self.spec.run,
            version=self.state.version,
            fragment_versions=dict(self.state.fragment_versions),
            snapshot_version=self.state.snapshot_version,
            merges=self.state.merges,
            merges_per_minute=len(recent),
            last_merge=self.last_merge,
            quorum=self.decisions.policy.quorum,
            effective_quorum=self.decisions.effective_quorum(now),
            grace_seconds=self.decisions.grace_seconds(now),
            live_learners=sorted(self.decisions.live_learners(now)),
            pending={p: sorted(r.pending) for p, r in self.decisions.rounds.items() if r.pending},
            reasons=dict(sorted(self.reasons.items())),
            evaluations=self.state.evaluations,
            parameters=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
            place=self.spec.syncer.place,
            storage={
                name: self.storage_before.get(name, StorageCounters()).plus(bucket.store.meter.snapshot())
                for name, bucket in self.buckets.items()
            },
            home_storage=self.home_storage_before.plus(self.home.store.meter.snapshot()),
            refusals=self.refusals,
            repairs=self.publication.repairs,
            leftovers_removed=sum(sweeper.removed for sweeper in self.sweepers.values()),
            unreachable={name: outage.reason for name, outage in self.reachability.down.items()},
            outages=self.reachability.outages_seen,
            given_up=self.given_up,
            started_at=self.started_at,
            time=time.time(),
        )

    def _write_status(self, phase: SyncerPhase, now: float) -> None:
        status = self._status(phase, now)

        def write(name: str) -> None:
            try:
                self.buckets[name].write_syncer_status(status)
            except StorageError as error:
                log.warning("could not write the status to region %s: %s", name, error)

        self.fanout.each(write, self._reachable())

    # ------------------------------------------------------------------------ loop

    def _request_stop(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after the current merge", signum)
        self.stop_requested = True

    def _over(self, now: float) -> bool:
        """Every learner finished or was given up, and nothing is left to merge."""
        end = decisions.run_end(self.decisions, [spec.id for spec in self.spec.learners], now)
        self.given_up = dict(end.given_up)
        idle = (
            not self.observed
            and not self.pending_observations
            and not any(r.pending or r.merging for r in self.decisions.rounds.values())
        )
        return end.over and idle

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self._setup()
        try:
            while not self.stop_requested:
                wake = self._turn()
                if self.finished:
                    return EXIT_FINISHED
                time.sleep(max(0.0, wake - self.clock()))
            self._write_status(SyncerPhase.STOPPED, self.clock())
            return EXIT_STOPPED
        finally:
            self.fanout.close()

    def _turn(self) -> float:
        """One turn of the loop: observe, decide, act, upkeep; returns when to wake."""
        now = self.clock()
        read_beats = now - self._last["beats"] >= min(
            self.recipe.sync.status_seconds, self.recipe.training.heartbeat_seconds
        )
        if read_beats:
            self._last["beats"] = now
        self.decisions, actions = decisions.step(self.decisions, self._observe(read_beats), now)
        wake = now + self.recipe.sync.poll_seconds
        for action in actions:
            if isinstance(action, decisions.Merge):
                self._merge(action)
                self.reasons[action.fragment] = action.reason
                wake = now
            elif isinstance(action, decisions.Resync):
                self._resync(action)
            elif isinstance(action, decisions.Discard):
                log.info("discarding %s: %s", action.arrival.key, action.reason)
                self._retire(payload_id(action.arrival.key))
            elif isinstance(action, decisions.Wait):
                self.reasons[action.fragment] = action.reason
                if action.until is not None:
                    wake = min(wake, action.until)
        if read_beats:
            self._repair_from_reports()
            self._follow_manifest()
        behind = self.publication.behind - set(self.reachability.down)
        if behind and now - self._last["catch_up"] >= CATCH_UP_SECONDS:
            self.publication.catch_up(behind, self._head(), self._snapshot_payload)
            self._last["catch_up"] = now
        if now - self._last["sweep"] >= max(1.0, self.recipe.sync.leftover_seconds / 4):
            self._sweep(now)
            self._last["sweep"] = now
        if read_beats and self._over(self.clock()):
            self._finish()
        elif self.clock() - self._last["status"] >= self.recipe.sync.status_seconds:
            self._write_status(SyncerPhase.RUNNING, self.clock())
            self._last["status"] = self.clock()
        return wake

    def _sweep(self, now: float, all_of_them: bool = False) -> None:
        for name, sweeper in self.sweepers.items():
            if self.reachability.is_down(name):
                continue
            try:
                sweeper.sweep(now, all_of_them)
            except StorageError as error:
                log.warning("could not sweep %s: %s", sweeper.store.root, error)

    def _finish(self) -> None:
        if self.state.evaluations[-1].version != self.state.version:
            self.state.evaluations.append(self._evaluate(self.state.theta, self.state.version))
        self.finished = True
        self.publication.catch_up(set(self.buckets), self._head(), self._snapshot_payload)
        self._sweep(self.clock(), all_of_them=True)  # every learner is done: nothing is in flight
        self._write_status(SyncerPhase.FINISHED, self.clock())
        without = (
            f" without {', '.join(f'{m} ({why})' for m, why in sorted(self.given_up.items()))}" if self.given_up else ""
        )
        log.info("finished at version %d%s", self.state.version, without)


SAME_SEND = ("learner", "fragment", "base_version", "c_steps", "c_tokens", "step", "sent_at")
"""What a learner writes both into a payload's authenticated header and into its marker."""


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


def _loader(blob: bytes):
    return lambda: blob
