"""When a run is over: every learner done, nothing left to merge, every reducer empty.

The decisions say which learners finished or were given up
(:func:`diloco_cli.core.decisions.run_end`); :class:`RunEnd` adds what only the syncer's
observations show: nothing observed or in flight, the last scan of every region that
holds a learner saw all of it, the other syncer shards finished, and each region's
reducer holds nothing (a reducer that still reports holding something is waited for as
a learner would be, up to ``sync.give_up_seconds``).
"""

from __future__ import annotations

import logging

from diloco_cli.core import decisions
from diloco_cli.core.types import LearnerId
from diloco_cli.runtime.syncer.evaluation import Evaluator
from diloco_cli.runtime.syncer.observation import Observer
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.syncer")


class RunEnd:
    """Whether the run is over, and why not when every learner is done."""

    def __init__(self, observer: Observer, evaluator: Evaluator, give_up_seconds: float) -> None:
        self.observer, self.evaluator, self.give_up_seconds = observer, evaluator, give_up_seconds
        self.given_up: dict[LearnerId, str] = {}
        """The learners the run ends without, and why (as of the last check)."""
        self.ending: str | None = None
        """Why the run has not ended though every learner is done (for ``diloco status``)."""
        self._held_since: float | None = None
        """Since when only a reducer's report holds up the end (syncer clock)."""

    def over(self, spec: RunSpec, decided: decisions.DecisionState, outcomes_waiting: bool, now: float) -> bool:
        """Every learner finished or was given up, and nothing is left to merge: nothing
        observed or in flight (``outcomes_waiting``: merges the decisions have not heard
        of), and the last scan of every region that holds a learner not given up saw all
        of it (a scan cut short may have missed a last payload)."""
        end = decisions.run_end(decided, [learner.id for learner in spec.learners], now)
        self.given_up = dict(end.given_up)
        rounds = decided.rounds.values()
        idle = self.observer.idle and not outcomes_waiting and not any(r.pending or r.merging for r in rounds)
        waited_on = {learner.region for learner in spec.learners if learner.id not in self.given_up}
        seen_whole = all(self.observer.whole[region] for region in waited_on)
        ended = end.over and idle and seen_whole and self.evaluator.others_finished()
        held = sorted(region for region in waited_on if not self._reducer_done(spec, region))
        self.ending = None
        if not ended or not held:
            self._held_since = None
            return ended
        # every input is in; a reducer that still reports holding something (dead, wiped,
        # or holding what can no longer be merged) is waited for as a learner would be
        self._held_since = now if self._held_since is None else self._held_since
        waited, limit, regions = now - self._held_since, self.give_up_seconds, ", ".join(held)
        if waited < limit:
            self.ending = (
                f"every learner is done and nothing is left to merge, but the reducer of region {regions} has "
                f"reported sends or aggregates it holds for {waited:.0f} s; the run ends without them after "
                f"sync.give_up_seconds ({limit:.0f} s) (see `diloco logs {spec.run} reducer-{held[0]}`)"
            )
            return False
        log.warning("ending without what the reducer of region %s holds: it waited %.0f s for it", regions, waited)
        return True

    def _reducer_done(self, spec: RunSpec, region: str) -> bool:
        """The region's reducer holds nothing (no send waiting, no aggregate in flight)
        and has seen the last heartbeat the syncer has of each of its learners."""
        status = self.observer.reducer_status.get(region)
        if status is None or status.waiting or status.in_flight:
            return False
        beats = self.observer.heartbeats
        learners = [s.id for s in spec.learners if s.region == region and s.id not in self.given_up]
        return all(
            learner in beats and status.heartbeats_seen.get(learner) == beats[learner].time for learner in learners
        )
