"""What ``diloco scale`` and ``diloco chaos`` change in a running run, as the syncer takes it in.

The syncer follows the run's manifest (:class:`~diloco_cli.runtime.membership.ManifestWatch`):
a new chaos plan changes the buckets' outage windows from now on; learners added or
drained change M and K in the decisions; and each learner gets its note (drain, its slice
of the data, H under dynamic local updates) from the syncer that speaks for the run's
membership (the only one, or shard 0).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from diloco_cli.core import decisions
from diloco_cli.runtime.coordinator import same_run
from diloco_cli.runtime.membership import ControlNotes, ManifestWatch
from diloco_cli.runtime.syncer.context import SyncerContext
from diloco_cli.runtime.syncer.observation import Observer
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.syncer")


class ManifestFollower:
    """The syncer's side of the run's membership and chaos plan."""

    def __init__(
        self, manifest: ManifestWatch | None, context: SyncerContext, observer: Observer, notes: ControlNotes
    ) -> None:
        self.manifest = manifest
        """The run's manifest (None: a syncer that follows none, in tests)."""
        self.context, self.observer, self.notes = context, observer, notes

    @property
    def speaks_for_membership(self) -> bool:
        """Whether this syncer writes the notes of the run's membership (drain, data
        slices, H under dynamic local updates): the only syncer, or shard 0 of several;
        every shard writes its own resync requests."""
        return self.context.shard.index == 0

    def follow(
        self, spec: RunSpec, decided: decisions.DecisionState, now: float
    ) -> tuple[RunSpec, decisions.DecisionState]:
        """Take in what changed in the manifest since ``spec``, deliver the learners'
        notes; returns the run spec and decision state that follow."""
        changed = same_run(self.manifest.changed() if self.manifest else None, spec)
        if changed is not None and changed.chaos != spec.chaos:
            for name in self.context.buckets:
                faults = changed.faults_of(name)
                self.context.buckets[name].store.faults = self.observer.probes[name].store.faults = faults
            spec = spec.model_copy(update={"chaos": changed.chaos})
            log.info("the run's chaos plan changed: outages are injected as it says from now on")
        if changed is not None and changed.learners != spec.learners:
            spec, decided = changed, _follow_membership(spec, changed, decided)
        down = set(self.observer.reachability.down)
        if self.speaks_for_membership:
            self.notes.follow(spec, skip=down)
        if self.context.recipe.sync.dynamic_local_updates and self.speaks_for_membership:
            live = decided.live_learners(now)
            heartbeats = self.observer.heartbeats
            times = {m: beat.step_seconds for m, beat in heartbeats.items() if m in live and beat.step_seconds}
            self.notes.follow_speeds(spec, times, skip=down)
        self.notes.deliver(skip=down)
        return spec, decided


def _follow_membership(before: RunSpec, spec: RunSpec, decided: decisions.DecisionState) -> decisions.DecisionState:
    """Learners added or drained: M and K follow."""
    policy = replace(decided.policy, num_learners=len(spec.active_learners), quorum=spec.recipe.quorum)
    added = sorted({s.id for s in spec.learners} - {s.id for s in before.learners})
    drained_before = {s.id for s in before.learners if s.drain}
    draining = sorted(s.id for s in spec.learners if s.drain and s.id not in drained_before)
    log.info(
        "the run now has M=%d learners, K=%d%s%s",
        policy.num_learners,
        policy.quorum,
        f"; added {', '.join(added)}" if added else "",
        f"; draining {', '.join(draining)}" if draining else "",
    )
    return replace(decided, policy=policy)
