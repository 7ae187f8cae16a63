"""The run's coordinators as their reports show them: the syncer (each syncer shard, and
the shards as one) and the regions' reducers, for ``diloco status`` (:mod:`.run_state`)
and ``diloco report``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco_cli.store.documents import ReducerStatus, SyncerStatus

SYNCER_SILENT_SECONDS = 30.0
"""A syncer status older than this is reported as not reporting."""


@dataclass
class SyncerSummary:
    state: str
    last_report_seconds: float | None
    last_merge_seconds_ago: float | None
    last_merge: dict[str, Any] | None
    merges: int
    merges_per_minute: int
    quorum: int | None
    effective_quorum: int | None
    grace_seconds: float | None
    live_learners: list[str]
    reasons: dict[str, str]
    repairs: int = 0
    leftovers_removed: int = 0
    given_up: dict[str, str] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    """Regions the syncer cannot reach now, with its last error."""
    outages: int = 0
    name: str = "syncer"
    """The process: ``syncer``, or a shard's ``syncer-<s>`` (the run's sum is ``syncers``)."""
    version: int = 0
    """Versions it published (its head's)."""
    ending: str | None = None
    """Why the run has not ended though every learner is done."""


@dataclass
class ReducerSummary:
    """A region's reducer, as its status in the region's bucket says."""

    region: str
    state: str
    """running, finished, stopped, not reporting, refusing (its version 0 differs), or
    starting (no report yet)."""
    version: int = 0
    aggregates: int = 0
    sends: int = 0
    voided: int = 0
    waiting: dict[str, list[str]] = field(default_factory=dict)
    """Per fragment, the learners whose sends wait to be forwarded."""
    in_flight: dict[str, list[str]] = field(default_factory=dict)
    """Per fragment, the learners whose sends wait in aggregates not merged yet."""
    last_report_seconds: float | None = None
    shard: int | None = None
    """The syncer shard it reduces for, in a run of several."""


def run_state(syncers: Sequence[SyncerStatus | None], now: float) -> str:
    """starting, running, finished, stopped, or syncer not reporting, from the status of
    each syncer shard (the run's only syncer): finished once every one has; ``collect_status``
    says syncer down when a supervisor says so."""
    if any(syncer is None for syncer in syncers):
        return "starting"
    phases = [syncer.state.value for syncer in syncers]
    final = ("finished", "stopped")
    if any(phase not in final and now - syncer.time > SYNCER_SILENT_SECONDS for phase, syncer in zip(phases, syncers)):
        return "syncer not reporting"
    if all(phase in final for phase in phases):
        return "finished" if all(phase == "finished" for phase in phases) else "stopped"
    return next(phase for phase in phases if phase not in final)


def syncer_summary(syncer: SyncerStatus | None, silent: bool, now: float, down: bool = False) -> SyncerSummary:
    """The syncer as its last report shows it; ``down``: its supervisor says it is not
    running, whatever that report said."""
    if syncer is None:
        return SyncerSummary("down" if down else "starting", None, None, None, 0, 0, None, None, None, [], {})
    merge = syncer.last_merge
    return SyncerSummary(
        state="down" if down else "not reporting" if silent else syncer.state.value,
        last_report_seconds=now - syncer.time,
        last_merge_seconds_ago=now - merge.time if merge else None,
        last_merge=merge.model_dump() if merge else None,
        merges=syncer.merges,
        merges_per_minute=syncer.merges_per_minute,
        quorum=syncer.quorum,
        effective_quorum=syncer.effective_quorum,
        grace_seconds=syncer.grace_seconds,
        live_learners=list(syncer.live_learners),
        reasons={str(p): reason for p, reason in syncer.reasons.items()},
        repairs=syncer.repairs,
        leftovers_removed=syncer.leftovers_removed,
        given_up=dict(syncer.given_up),
        unreachable=dict(syncer.unreachable),
        outages=syncer.outages,
        ending=syncer.ending,
    )


def shards_as_one(shards: list[SyncerSummary]) -> SyncerSummary:
    """The syncer shards as one: the run's merges and what each shard says (the quorum,
    grace window and live learners as shard 0 sees them)."""
    first = shards[0]
    merges = [shard for shard in shards if shard.last_merge is not None]
    newest = min(merges, key=lambda shard: shard.last_merge_seconds_ago, default=None)
    states = {shard.state for shard in shards}
    worst = next((state for state in ("down", "not reporting", "starting") if state in states), first.state)
    return SyncerSummary(
        state=worst if len(states) > 1 else first.state,
        last_report_seconds=max(
            (s.last_report_seconds for s in shards if s.last_report_seconds is not None), default=None
        ),
        last_merge_seconds_ago=newest.last_merge_seconds_ago if newest else None,
        last_merge=newest.last_merge if newest else None,
        merges=sum(shard.merges for shard in shards),
        merges_per_minute=sum(shard.merges_per_minute for shard in shards),
        quorum=first.quorum,
        effective_quorum=first.effective_quorum,
        grace_seconds=first.grace_seconds,
        live_learners=first.live_learners,
        reasons={p: reason for shard in shards for p, reason in shard.reasons.items()},
        repairs=sum(shard.repairs for shard in shards),
        leftovers_removed=sum(shard.leftovers_removed for shard in shards),
        given_up={learner: why for shard in shards for learner, why in shard.given_up.items()},
        unreachable={region: why for shard in shards for region, why in shard.unreachable.items()},
        outages=sum(shard.outages for shard in shards),
        name="syncers",
        ending="; ".join(shard.ending for shard in shards if shard.ending) or None,
        version=sum(shard.version for shard in shards),
    )


def reducer_summary(region: str, reducer: ReducerStatus | None, now: float, shard: int | None) -> ReducerSummary:
    if reducer is None:
        return ReducerSummary(region, "starting", shard=shard)
    if reducer.initial_weights == "differ":
        state = "refusing (its version 0 differs from the syncer's)"
    elif reducer.finished:
        state = "finished"
    elif now - reducer.time > SYNCER_SILENT_SECONDS:
        state = "not reporting"
    else:
        state = "running"
    return ReducerSummary(
        region=region,
        state=state,
        version=reducer.version,
        aggregates=reducer.aggregates,
        sends=reducer.sends,
        voided=reducer.voided,
        waiting={str(p): learners for p, learners in reducer.waiting.items()},
        in_flight={str(p): learners for p, learners in reducer.in_flight.items()},
        last_report_seconds=now - reducer.time,
        shard=shard,
    )
