"""A region's reducer: its learners' sends become one aggregate per fragment before the WAN.

One supervised process per region, beside the region's bucket.  Each turn reads top to
bottom:

1. **follow the global weights**: every few seconds read the learners' heartbeats (who
   may still send, which of the region's snapshots they found damaged); read the head;
   bring the region's copy up to it (:mod:`.region_copy`);

Steps 2 to 4 are decided by the pure :func:`diloco_cli.core.reducer_step.step` on what
the turn read in the region's bucket; :mod:`.region_objects` reads it, and carries out
the actions:

2. **resolve**: an aggregate whose fragment moved on was merged (the head's ``merged``
   marks cover its sends: its payloads are deleted) or discarded (its sends wait again,
   its error feedback goes back); payloads the syncer merged are deleted;
3. **look**: new payloads of the region's learners (markers verified);
4. **forward**: for each fragment, the sends the forwarding decides on
   (:mod:`diloco_cli.core.forwarding`)
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
import time
from dataclasses import replace

import torch

from diloco_cli.codec import PayloadError, RunSecret
from diloco_cli.codec.parallel import resolve_threads
from diloco_cli.core import reducer_step
from diloco_cli.core.cadence import Cadences
from diloco_cli.core.forwarding import ForwardPolicy
from diloco_cli.core.fragments import SyncerShard, fragments_of_model
from diloco_cli.core.heartbeats import Heartbeats
from diloco_cli.core.reducer_step import ReducerState
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.coordinator import (
    EXIT_STOPPED,
    REPEAT_SECONDS,
    Liveness,
    RefusalCount,
    StopSignals,
    heartbeats_due,
    run_turns,
    same_run,
    take_in_heartbeat,
)
from diloco_cli.runtime.membership import ManifestWatch
from diloco_cli.runtime.reducer.aggregation import Aggregation
from diloco_cli.runtime.reducer.region_copy import RegionCopy, VersionZero
from diloco_cli.runtime.reducer.region_objects import RegionObjects
from diloco_cli.runtime.reducer.replica import GlobalReplica
from diloco_cli.runtime.workspace import MergeWorkspace
from diloco_cli.store import aggregates as store
from diloco_cli.store.documents import Head, Heartbeat, HeartbeatHeard, ReducerStatus, Refusals
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageCounters
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.reducer")


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
        self.state = ReducerState()
        """What it holds: sends waiting, aggregates in flight, relays (:mod:`diloco_cli.core.reducer_step`)."""
        self.copy: RegionCopy | None = None
        """The region's copy of the global weights (from :meth:`start`)."""
        self.heard: Heartbeats[Heartbeat] = Heartbeats()
        """Per learner of the region: its newest heartbeat (its progress: when it is due to
        finish); replayed older ones are refused."""
        self.report_soon = False
        """A learner stopped going on, or the reducer let go of the last thing it held, since
        the last status: write it at the next turn that can."""
        self.holding = False
        """Whether the reducer held sends (waiting, in an aggregate, relayed) after its last turn."""
        self.refusal_count = RefusalCount(log, repeat_seconds=REPEAT_SECONDS)
        """What it refused, counted in its status (a damaged update is met every turn until
        the syncer rewrites it: counted again at most every few seconds)."""
        self.started_at = time.time()
        self.cadences = Cadences("beats", "ending", "status")

    # ----------------------------------------------------------------------- start

    def start(self) -> None:
        """Build the model from the recipe's seed (version 0, checked once a head says
        what the syncer's is), count this start, and pick up what a killed reducer left."""
        sync = self.recipe.sync
        self.liveness = Liveness(started_at=self.clock())
        torch.manual_seed(self.recipe.training.seed)
        model = self.recipe.model.build()
        fragments = fragments_of_model(model, sync.num_fragments, sync.merge)
        owned = self.shard.of(fragments)
        initial = {name: parameter.detach() for name, parameter in model.named_parameters()}
        epoch = self.bucket.read_epoch(self.bucket.layout.reducer_name) + 1
        self.bucket.write_epoch(self.bucket.layout.reducer_name, epoch)
        workspace = MergeWorkspace(resolve_threads(sync.merge_threads))
        self.aggregation = Aggregation(self.bucket, fragments, sync.learner_codec, epoch, workspace, owned)
        model_zero = VersionZero(fragments, owned, initial)
        self.copy = RegionCopy(self.bucket, model_zero, sync.window_versions, self.refusal_count, self.clock)
        self.objects = RegionObjects(
            self.aggregation,
            self.copy,
            self.refusal_count,
            self.shard.owns,
            not self.spec.keeps_payloads,
            self._write_status,
        )
        self.storage_before = self._previous_counts()
        left = self.objects.left_by_an_earlier_start()
        self.state = replace(self.state, in_flight=left.in_flight, relayed=left.relayed)

    def _previous_counts(self) -> StorageCounters:
        """What the reducer's earlier start counted (from its status), counted on."""
        try:
            status = store.read_reducer_status(self.bucket)
        except PayloadError:
            return StorageCounters()
        if status is None:
            return StorageCounters()
        counts = {"aggregates": status.aggregates, "sends": status.sends, "voided": status.voided}
        self.state = replace(self.state, counts=counts, refused_payloads=frozenset(status.refused_payloads))
        self.copy.snapshot_version = status.snapshot_version
        self.refusal_count.refusals = status.refusals  # counted on from there, as the storage counts are
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

    # ------------------------------------------------------------- what it holds

    @property
    def replica(self) -> GlobalReplica | None:
        return self.copy.replica if self.copy else None

    @property
    def initial_weights(self) -> str:
        return self.copy.initial_weights if self.copy else "unchecked"

    @property
    def waiting(self):
        """Sends not forwarded yet, by payload key."""
        return self.state.waiting

    @property
    def in_flight(self):
        """Aggregates forwarded and not resolved yet, by key."""
        return self.state.in_flight

    @property
    def relayed(self):
        """Sends relayed (under K < M) that the syncer has not let go yet, by relay key."""
        return self.state.relayed

    @property
    def counts(self):
        return self.state.counts

    @property
    def refused_payloads(self):
        return self.state.refused_payloads

    @property
    def refusals(self) -> Refusals:
        return self.refusal_count.refusals

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
            every = self.recipe.training.heartbeat_seconds
            read_heartbeats = heartbeats_due(self.cadences, now, every, self.heard.newest.values())
        if read_heartbeats:
            self._follow_manifest()
            self.report_soon |= self._read_heartbeats()
            self._apply(self.objects.own_objects(), self.clock())
            self._heard_of_a_wipe()
        head = self._read_head()
        if head is None or not self._follow(head):
            return wake
        self._apply([reducer_step.HeadSeen(head, dict(self.copy.versions))], now)  # resolve
        self._apply(self.objects.payloads(self.state, head), now)  # look
        due = reducer_step.ForwardingDue(self._policy(), frozenset(self._live()), dict(self.copy.versions))
        self._apply([due], now)  # forward
        holding = self.state.holding
        self.report_soon |= self.holding and not holding  # the end of the run waits for a status holding nothing
        self.holding = holding
        # a finished head is not the end while a learner of the region may still send: after
        # `diloco resume` brings one back, this reducer may read the head before the syncer rewrites it
        if head.finished and not holding and not self._live():
            self.finished = True
            self._write_status()
            log.info("finished: the run is over and nothing of this region waits")
        elif self.cadences.due("status", now, sync.status_seconds) or self.report_soon:
            self._write_status()  # and at once when a learner stopped going on: the syncer waits for it at the end
        return wake

    def _apply(self, observations: list[reducer_step.Observation], now: float) -> None:
        """Fold observations into the state and carry out the actions in the region's
        bucket, each one's outcome folded at once (a later action sees it)."""
        self.state, actions = reducer_step.step(self.state, observations, now)
        for action in actions:
            outcomes = self.objects.act(action)
            if outcomes:
                self.state, more = reducer_step.step(self.state, outcomes, now)
                for removal in more:  # what an outcome calls for: refused payloads to remove
                    self.objects.act(removal)

    # --------------------------------------------------- following the global weights

    def _read_head(self) -> Head | None:
        try:
            return self.bucket.read_head()
        except PayloadError as error:
            self.refusal_count.refused("head", self.bucket.layout.head_key, error)
        except StorageError as error:
            log.warning("the head cannot be read now: %s", error)
        return None

    def _heard_of_a_wipe(self) -> None:
        """The region's bucket was wiped: its learners' counts of starts went with it."""
        if self.objects.wiped:
            self.heard.lose_starts(learner.id for learner in self.spec.learners if learner.region == self.region)
            self.objects.wiped = False

    def _follow(self, head: Head) -> bool:
        """Bring the region's copy up to the head; False while it cannot be (no copy)."""
        if self.copy.replica is None:
            numbered = self.objects.number_after(head)
            self._heard_of_a_wipe()
            if not numbered:
                return False
            if not self.copy.build(head):
                self._write_status()  # it refuses to reduce: its status says why
                return False
            self.objects.restore_errors(head, self.state)
        self.copy.follow(head)
        return True

    # ------------------------------------------------------------- its learners

    def _read_heartbeats(self) -> bool:
        """Take in the region's heartbeats; whether a learner stopped going on (finished,
        stopped, failed) since the last read."""
        now = self.clock()
        stopped_going = False
        for learner in (spec.id for spec in self.spec.learners if spec.region == self.region):
            try:
                beat: Heartbeat | PayloadError | None = self.bucket.read_heartbeat(learner)
            except PayloadError as error:
                beat = error
            except StorageError as error:
                log.warning("the heartbeat of %s cannot be read now: %s", learner, error)
                continue
            heard = take_in_heartbeat(self.heard, learner, beat, self.refusal_count.refused)
            if heard is None:
                continue
            if heard.news:
                stopped_going |= self.liveness.heard(learner, self.heard.newest[learner].state.value, now)
            if heard.replay is None:
                self.copy.take_in_notes(learner, beat)
        return stopped_going

    def _follow_manifest(self) -> None:
        """Learners added or drained (``diloco scale``): the region's share and who may
        still send follow."""
        spec = same_run(self.manifest.changed() if self.manifest else None, self.spec)
        if spec is not None:
            self.spec = spec

    def _live(self) -> set[LearnerId]:
        """The region's learners that may still send: not gone, heard from lately (or
        not yet heard from while the run is young)."""
        learners = [spec.id for spec in self.spec.active_learners if spec.region == self.region]
        return self.liveness.live(learners, self.clock(), self.recipe.sync.liveness_timeout_seconds)

    # ------------------------------------------------------------------------ report

    def status(self) -> ReducerStatus:
        """The reducer's status document as of now."""
        state, copy, replica = self.state, self.copy, self.replica
        in_flight: dict[FragmentIndex, list[LearnerId]] = {}
        for record in state.in_flight.values():
            if record.sends:  # one without sends holds nothing the syncer waits for
                in_flight.setdefault(record.fragment, []).extend(send.learner for send in record.sends)
        for relayed in state.relayed.values():
            in_flight.setdefault(relayed.fragment, []).append(relayed.learner)
        waiting: dict[FragmentIndex, list[LearnerId]] = {}
        for item in state.waiting.values():
            waiting.setdefault(item.fragment, []).append(item.send.learner)
        return ReducerStatus(
            region=self.region,
            version=replica.version if replica else Version(0),
            fragment_versions=dict(replica.versions) if replica else {},
            aggregates=state.counts["aggregates"],
            sends=state.counts["sends"],
            voided=state.counts["voided"],
            in_flight={p: sorted(set(learners)) for p, learners in in_flight.items()},
            waiting={p: sorted(set(learners)) for p, learners in waiting.items()},
            snapshot_version=max(copy.snapshot_version if copy else Version(-1), Version(0)),
            initial_weights=self.initial_weights,
            heartbeats_seen={learner: beat.time for learner, beat in self.heard.newest.items()},
            heartbeats=HeartbeatHeard.of(self.heard.newest),
            needs_snapshot=copy.needs_snapshot if copy else False,
            storage=self.storage_before.plus(self.bucket.store.meter.snapshot()),
            refusals=self.refusals,
            refused_payloads=sorted(state.refused_payloads),
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


def run_reducers(reducers: list[Reducer]) -> int:
    """Run a region's reducers (one per syncer shard) in this process, each turn in turn,
    until every one has finished or a signal (SIGTERM, SIGINT) stops them."""
    stop = StopSignals("this turn", log)
    for reducer in reducers:
        reducer.start()
    code = run_turns(reducers, reducers[0].clock, stop)
    if code == EXIT_STOPPED:
        for reducer in reducers:
            reducer._write_status()
    return code
