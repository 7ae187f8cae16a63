"""The syncer process: poll every region's bucket, decide, merge, commit, publish.

Each loop lists the buckets for new marked payloads (their markers verified), reads the
heartbeats, and feeds both to the pure decision state machine
(:mod:`diloco_cli.core.decisions`).  A merge is computed by
:func:`~diloco_cli.runtime.merge_round.merge_round`, committed to the home store, and
only then published to every region (one upload per region: the WAN cost), with a full
snapshot every S versions.  The global model is evaluated on held-out text every N
versions.  Killed at any instant, the syncer restarts from its commits with no arrival
lost and none merged twice.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import deque
from typing import Any

import torch

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.codec.exact import ExactPublisher
from diloco_cli.core import decisions
from diloco_cli.core.fragments import fragments_of_model
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.global_weights import Head, encode_snapshot
from diloco_cli.runtime.merge_round import RoundInput, merge_round
from diloco_cli.runtime.run_spec import RunSpec
from diloco_cli.runtime.syncer_state import SyncerState, commit_merge, restore_state
from diloco_cli.store.region import PAYLOAD_KEY, PayloadRecord, RegionBucket
from diloco_cli.training.data import TextSplit, evaluation_batches, load_text
from diloco_cli.training.inner import evaluate

log = logging.getLogger("diloco.syncer")

EXIT_FINISHED = 0
EXIT_STOPPED = 143
STATUS_SECONDS = 2.0
TERMINAL_LEARNER_STATES = ("finished",)
STOPPED_LEARNER_STATES = ("finished", "stopped", "failed")


def qualified(region: str, key: str) -> str:
    """A payload key made unique across regions (the form the ledger stores)."""
    return f"{region}:{key}"


class Syncer:
    def __init__(self, spec: RunSpec, secret: RunSecret, clock=time.monotonic) -> None:
        self.spec = spec
        self.recipe = spec.recipe
        self.secret = secret
        self.clock = clock
        self.stop_requested = False
        self.buckets = {bucket.name: bucket for bucket in spec.buckets(secret)}
        self.home = spec.home(secret)
        self.observed: dict[str, PayloadRecord] = {}
        self.retired_unmerged: set[str] = set()
        """Payloads consumed without a merge and kept (delete_consumed_payloads: false)."""
        self.pending_observations: list[decisions.Observation] = []
        self.heartbeats: dict[LearnerId, dict[str, Any]] = {}
        self.reasons: dict[int, str] = {}
        self.merge_times: deque[float] = deque(maxlen=50)
        self.last_merge: dict[str, Any] | None = None
        self.started_at = time.time()

    # ----------------------------------------------------------------------- setup

    def _setup(self) -> None:
        recipe = self.recipe
        torch.manual_seed(recipe.training.seed)
        self.model = recipe.model.build()
        self.fragments = fragments_of_model(self.model, recipe.sync.num_fragments)
        initial = {name: p.detach() for name, p in self.model.named_parameters()}
        optimizer = NesterovOuterOptimizer(recipe.outer_learning_rate, recipe.sync.outer_momentum)
        publisher = ExactPublisher(recipe.sync.update_codec, self.secret)
        self.state: SyncerState = restore_state(self.home, self.secret, self.fragments, initial, optimizer, publisher, recipe.sync.window_versions)
        meta = self.state.meta
        self.snapshot_version = Version(int(meta.get("snapshot_version", 0)))
        self.evaluations: list[dict[str, Any]] = list(meta.get("evaluations", []))
        self.merges = int(meta.get("merges", 0))
        policy = decisions.DecisionPolicy(
            num_learners=len(self.spec.learners),
            quorum=recipe.quorum,
            num_fragments=len(self.fragments),
            grace_gamma=recipe.sync.grace_gamma,
            overlap_steps=recipe.sync.overlap_steps,
            max_grace_seconds=recipe.sync.max_grace_seconds,
            liveness_timeout_seconds=recipe.sync.liveness_timeout_seconds,
        )
        versions = {f.index: (self.state.fragment_versions[f.index], self.state.windows[f.index].oldest_anchorable) for f in self.fragments}
        decision_state = decisions.initial_state(policy, self.clock(), versions)
        merged_sequence: dict[tuple[LearnerId, FragmentIndex], int] = {}
        for commit in self.state.commits:
            for key in commit.merged:
                match = PAYLOAD_KEY.match(key.split(":", 1)[1])
                if match:
                    slot = (LearnerId(match["learner"]), FragmentIndex(int(match["fragment"])))
                    merged_sequence[slot] = max(merged_sequence.get(slot, -1), int(match["sequence"]))
        self.decisions = decisions.DecisionState(
            policy=policy,
            rounds=decision_state.rounds,
            started_at=decision_state.started_at,
            merged_sequence=merged_sequence,
            quorum_seconds=meta.get("quorum_seconds"),
            sync_seconds=meta.get("sync_seconds"),
        )
        split = TextSplit.of(load_text(recipe.data.source, recipe.data.storage_options), recipe.data.heldout_fraction, recipe.data.sequence_length)
        self.heldout = evaluation_batches(split.heldout, recipe.training.batch_size, recipe.data.sequence_length, recipe.sync.evaluation_batches)
        self._catch_up_regions()
        if not self.evaluations:
            self._evaluate()

    def _head(self) -> Head:
        recent_from = max(0, self.snapshot_version - self.recipe.sync.snapshot_every)
        recent = tuple((c.version, c.fragment) for c in self.state.commits if c.version > recent_from)
        return Head(
            version=self.state.version,
            fragment_versions=dict(self.state.fragment_versions),
            snapshot_version=self.snapshot_version,
            recent=recent,
            recent_from=Version(recent_from),
            finished=False,
        )

    def _catch_up_regions(self) -> None:
        """After a (re)start: every region gets the snapshot and the committed updates it
        misses (writing an immutable object that exists is skipped), then the head."""
        head = self._head()
        for bucket in self.buckets.values():
            if self.snapshot_version not in bucket.snapshot_versions():
                if self.snapshot_version != self.state.version:
                    # the snapshot's version is gone from memory: snapshot the present instead
                    self.snapshot_version = self.state.version
                    return self._catch_up_regions()
                bucket.write_snapshot(self.snapshot_version, self._snapshot_payload())
            for version, fragment in head.recent:
                bucket.publish_update(version, fragment, self.home.read_update(version))
            bucket.write_head(head.to_json())
        return None

    def _snapshot_payload(self) -> bytes:
        return encode_snapshot(self.state.theta, self.secret, self.state.version, self.state.fragment_versions)

    # ---------------------------------------------------------------- observations

    def _observe(self, now: float, read_heartbeats: bool) -> list[decisions.Observation]:
        observations = self.pending_observations
        self.pending_observations = []
        for region, bucket in self.buckets.items():
            for key in bucket.payload_keys():
                name = qualified(region, key)
                if name in self.state.ledger:
                    if self.recipe.sync.delete_consumed_payloads:
                        bucket.delete_payload(key)
                    continue
                if name in self.observed or name in self.retired_unmerged:
                    continue
                try:
                    record = bucket.payload_record(key)
                except FileNotFoundError:
                    continue
                except PayloadError as error:
                    log.warning("refusing payload %s: %s", name, error)
                    self._retire(name)
                    continue
                self.observed[name] = record
                observations.append(
                    decisions.ArrivalSeen(
                        decisions.Arrival(
                            learner=record.learner,
                            fragment=record.fragment,
                            base_version=record.base_version,
                            c_steps=record.c_steps,
                            c_tokens=record.c_tokens,
                            sequence=record.sequence,
                            key=name,
                        )
                    )
                )
            if read_heartbeats:
                for learner, beat in bucket.read_heartbeats().items():
                    previous = self.heartbeats.get(learner)
                    self.heartbeats[learner] = beat
                    if previous is None or previous.get("time") != beat.get("time"):
                        observations.append(
                            decisions.HeartbeatSeen(learner, beat.get("step_seconds"), stopped=beat.get("state") in STOPPED_LEARNER_STATES)
                        )
        return observations

    # ---------------------------------------------------------------------- merges

    def _bucket_and_key(self, name: str) -> tuple[RegionBucket, str]:
        region, key = name.split(":", 1)
        return self.buckets[region], key

    def _merge(self, action: decisions.Merge) -> None:
        started = self.clock()
        fragment = action.fragment
        version = Version(self.state.version + 1)
        inputs = []
        for arrival in action.arrivals:
            bucket, key = self._bucket_and_key(arrival.key)
            inputs.append(RoundInput(arrival.learner, arrival.base_version, arrival.c_steps, arrival.c_tokens, lambda b=bucket, k=key: b.read_payload(k)))
        names = self.fragments[fragment].embedding_names
        result = merge_round(
            fragment,
            version,
            inputs,
            self.state.fragment_theta(fragment),
            self.state.windows[fragment],
            self.state.optimizer,
            self.state.publisher,
            self.secret,
            mean_names=names,
            meta={"time": time.time()},
        )
        merged = [a.key for a, r in zip(action.arrivals, inputs) if r in result.merged]
        rejected = [a.key for a, r in zip(action.arrivals, inputs) if any(r is bad for bad, _ in result.rejected)]
        for bad, error in result.rejected:
            log.warning("refused %s's payload for fragment %d: %s", bad.learner, fragment, error)
        retired = [a.key for a in action.superseded] + rejected
        self.merges += 1
        if version - self.snapshot_version >= self.recipe.sync.snapshot_every:
            self.snapshot_version = version
        seconds = self.clock() - started
        meta = {
            "time": time.time(),
            "merges": self.merges,
            "seconds": seconds,
            "learners": [a.learner for a, r in zip(action.arrivals, inputs) if r in result.merged],
            "snapshot_version": self.snapshot_version,
            "quorum_seconds": self.decisions.quorum_seconds,
            "sync_seconds": self.decisions.sync_seconds,
            "evaluations": self.evaluations[-50:],
        }
        keep_after = Version(max(0, self.snapshot_version - self.recipe.sync.snapshot_every))
        commit_merge(self.home, self.state, self.secret, fragment, version, result.payload, merged, retired, meta, keep_after)
        self._publish(version, fragment, result.payload)
        if self.recipe.sync.delete_consumed_payloads:
            for name in merged + retired:
                bucket, key = self._bucket_and_key(name)
                bucket.delete_payload(key)
        for name in merged + retired:
            self.observed.pop(name, None)
        seconds = self.clock() - started
        self.merge_times.append(time.time())
        self.last_merge = {"fragment": fragment, "version": version, "learners": meta["learners"], "seconds": seconds, "time": time.time()}
        self.pending_observations.append(decisions.MergeFinished(fragment, version, self.state.windows[fragment].oldest_anchorable, seconds))
        log.info("version %d: fragment %d from %s in %.2f s", version, fragment, ", ".join(meta["learners"]) or "nobody", seconds)
        if version % self.recipe.sync.evaluate_every == 0:
            self._evaluate()

    def _publish(self, version: Version, fragment: FragmentIndex, payload: bytes) -> None:
        """One upload per region (the WAN cost), a snapshot every S versions, then heads."""
        snapshot = self._snapshot_payload() if self.snapshot_version == version else None
        head = self._head()
        for bucket in self.buckets.values():
            bucket.publish_update(version, fragment, payload)
            if snapshot is not None:
                bucket.write_snapshot(version, snapshot)
            bucket.write_head(head.to_json())
            if snapshot is not None:
                self._collect_garbage(bucket, head)

    def _collect_garbage(self, bucket: RegionBucket, head: Head) -> None:
        """Drop updates and snapshots no reader can need any more."""
        for version, fragment in bucket.update_versions():
            if version <= head.recent_from:
                bucket.delete_update(version, fragment)
        for version in bucket.snapshot_versions():
            if version < head.recent_from:
                bucket.delete_snapshot(version)

    def _resync(self, action: decisions.Resync) -> None:
        learner = self.spec.learner(action.learner)
        bucket = self.buckets[learner.region]
        control = bucket.read_control(action.learner)
        serial = int(control.get("resync_serial", 0)) + 1
        bucket.write_control(action.learner, {"resync_serial": serial, "fragment": action.fragment, "reason": action.reason, "time": time.time()})
        self._retire(action.arrival.key)
        log.info("told %s to resync: %s", action.learner, action.reason)

    def _retire(self, name: str) -> None:
        """A payload consumed without a merge (older than one merged, or unanchorable)."""
        if self.recipe.sync.delete_consumed_payloads:
            bucket, key = self._bucket_and_key(name)
            bucket.delete_payload(key)
        else:
            self.retired_unmerged.add(name)
        self.observed.pop(name, None)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self) -> None:
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(self.state.theta[name])
        loss = evaluate(self.model, self.heldout)
        tokens = sum(int(beat.get("tokens", 0)) for beat in self.heartbeats.values())
        self.evaluations.append({"version": self.state.version, "loss": loss, "tokens": tokens, "time": time.time()})
        log.info("version %d: held-out loss %.4f", self.state.version, loss)

    # ---------------------------------------------------------------------- status

    def _status(self, state: str, now: float) -> dict[str, Any]:
        live = self.decisions.live_learners(now)
        recent = [t for t in self.merge_times if t > time.time() - 60]
        pending = {str(p): sorted(r.pending) for p, r in self.decisions.rounds.items() if r.pending}
        return {
            "state": state,
            "run": self.spec.run,
            "version": self.state.version,
            "fragment_versions": {str(p): v for p, v in self.state.fragment_versions.items()},
            "snapshot_version": self.snapshot_version,
            "merges": self.merges,
            "merges_per_minute": len(recent),
            "last_merge": self.last_merge,
            "quorum": self.decisions.policy.quorum,
            "effective_quorum": self.decisions.effective_quorum(now),
            "grace_seconds": self.decisions.grace_seconds(now),
            "live_learners": sorted(live),
            "pending": pending,
            "reasons": {str(p): reason for p, reason in sorted(self.reasons.items())},
            "evaluations": self.evaluations[-200:],
            "bytes": {name: {"up": b.store.bytes.up, "down": b.store.bytes.down} for name, b in self.buckets.items()},
            "started_at": self.started_at,
            "time": time.time(),
        }

    def _write_status(self, state: str, now: float) -> None:
        status = self._status(state, now)
        for bucket in self.buckets.values():
            bucket.write_syncer_status(status)

    # ------------------------------------------------------------------------ loop

    def _request_stop(self, signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after the current merge", signum)
        self.stop_requested = True

    def _finished(self) -> bool:
        learners = [spec.id for spec in self.spec.learners]
        all_done = all(self.heartbeats.get(m, {}).get("state") in TERMINAL_LEARNER_STATES for m in learners)
        idle = not self.observed and not self.pending_observations and not any(r.pending or r.merging for r in self.decisions.rounds.values())
        return all_done and idle

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        self._setup()
        poll = self.recipe.sync.poll_seconds
        last_status = last_beats = float("-inf")
        while not self.stop_requested:
            now = self.clock()
            read_beats = now - last_beats >= min(STATUS_SECONDS, self.recipe.training.heartbeat_seconds)
            if read_beats:
                last_beats = now
            observations = self._observe(now, read_beats)
            self.decisions, actions = decisions.step(self.decisions, observations, now)
            wake = now + poll
            for action in actions:
                if isinstance(action, decisions.Merge):
                    self._merge(action)
                    self.reasons[action.fragment] = action.reason
                    wake = now
                elif isinstance(action, decisions.Resync):
                    self._resync(action)
                elif isinstance(action, decisions.Discard):
                    log.info("discarding %s: %s", action.arrival.key, action.reason)
                    self._retire(action.arrival.key)
                elif isinstance(action, decisions.Wait):
                    self.reasons[action.fragment] = action.reason
                    if action.until is not None:
                        wake = min(wake, action.until)
            if read_beats and self._finished():
                return self._finish()
            if self.clock() - last_status >= STATUS_SECONDS:
                self._write_status("running", self.clock())
                last_status = self.clock()
            time.sleep(max(0.0, wake - self.clock()))
        self._write_status("stopped", self.clock())
        return EXIT_STOPPED

    def _finish(self) -> int:
        if not self.evaluations or self.evaluations[-1]["version"] != self.state.version:
            self._evaluate()
        head = self._head()
        finished = Head(head.version, head.fragment_versions, head.snapshot_version, head.recent, head.recent_from, finished=True)
        for bucket in self.buckets.values():
            bucket.write_head(finished.to_json())
        self._write_status("finished", self.clock())
        log.info("finished at version %d", self.state.version)
        return EXIT_FINISHED
