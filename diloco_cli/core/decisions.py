"""The syncer's decisions as a pure state machine: ``step(state, observations, now)``.

Decoupled DiLoCo (arXiv 2604.21428, section 3) merges a fragment as soon as K of the M
learners have sent it (the quorum), then waits a little longer for stragglers only when
the wait is hidden behind the learners' overlap of tau steps: the grace window::

    grace = gamma * max(0, tau * xi_step - xi_quorum - xi_sync)

where ``xi_step`` is the slowest live learner's step time, ``xi_quorum`` the time from a
round's first arrival to its quorum and ``xi_sync`` the time to pull, merge and publish,
all exponential moving averages.  The window is capped and ends early when every live
learner has arrived.  Of a learner's arrivals made from the same base, the newest wins
and the older ones are superseded (a learner's delta is everything it did since that
base, so nothing is lost); arrivals from different bases hold different work and are all
merged.  A learner whose base version is older than the window of kept updates cannot
be anchored and is told to resync.  The run is over once every learner has finished or
has been gone (failed, stopped or silent) for ``give_up_seconds``: :func:`run_end`.

Arrivals may also come through a region's reducer, bundled in an *aggregate* (its
``group``) already anchored at a version of the fragment (its ``anchor``): the decisions
count their learners for the quorum and the grace window as any others, but an
aggregate is merged or discarded whole, and only while its anchor is the fragment's
version (an aggregate anchored before a merge of its fragment is discarded, and its
reducer forwards the same sends again, anchored anew).

Nothing here does I/O or reads a clock: observations and ``now`` come in, actions go out,
and whenever a fragment is not merged the action says why, in words (the action names
the fragment; its reason does not repeat it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from diloco_cli.core.heartbeats import GONE_STATES, is_live
from diloco_cli.core.types import FragmentIndex, LearnerId, Version

# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class DecisionPolicy:
    """The knobs of the syncer's decisions (see the recipe's ``syncer`` section)."""

    num_learners: int
    quorum: int
    num_fragments: int
    grace_gamma: float = 0.5
    overlap_steps: float = 2.0
    max_grace_seconds: float = 10.0
    ema_weight: float = 0.2
    liveness_timeout_seconds: float = 60.0
    give_up_seconds: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.quorum <= self.num_learners:
            raise ValueError(f"the quorum K must be between 1 and M={self.num_learners}, got {self.quorum}")
        if not 0 < self.ema_weight <= 1:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight}")


@dataclass(frozen=True)
class Arrival:
    """A verified, unconsumed learner payload for one fragment."""

    learner: LearnerId
    fragment: FragmentIndex
    base_version: Version
    c_steps: int
    c_tokens: int
    sequence: int
    """The learner's send counter: a larger one is newer."""
    key: str
    """Where the payload is stored (opaque to the decisions)."""
    group: str | None = None
    """The aggregate this arrival came in, if a reducer forwarded it (opaque)."""
    anchor: Version | None = None
    """The fragment's version its aggregate is anchored at (with ``group``)."""


@dataclass(frozen=True)
class ArrivalSeen:
    arrival: Arrival


@dataclass(frozen=True)
class ResyncRequested:
    """A reducer could not anchor this send (its base is older than the window)."""

    arrival: Arrival


@dataclass(frozen=True)
class HeartbeatSeen:
    learner: LearnerId
    step_seconds: float | None
    """The learner's current seconds per inner step, if it has measured one."""
    state: str = "training"
    """What the learner says it is doing (``finished``, ``failed``, ``training``...)."""


@dataclass(frozen=True)
class MergeFinished:
    fragment: FragmentIndex
    version: Version
    """The version the merge was published as."""
    oldest_anchorable: Version
    """The oldest base version the update window can still anchor after this merge."""
    seconds: float
    """Time to pull, merge and publish."""
    merged_keys: frozenset[str] | None = None
    """The keys of the arrivals merged (None: every arrival of the merge); an arrival
    refused when read does not count as merged."""


@dataclass(frozen=True)
class MergeAborted:
    """A merge could not read its payloads (storage failing): its arrivals wait again."""

    fragment: FragmentIndex


Observation = ArrivalSeen | ResyncRequested | HeartbeatSeen | MergeFinished | MergeAborted

# --------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Merge:
    """Merge these arrivals into fragment ``fragment``; retire ``superseded`` unmerged."""

    fragment: FragmentIndex
    arrivals: tuple[Arrival, ...]
    superseded: tuple[Arrival, ...]
    reason: str


@dataclass(frozen=True)
class Resync:
    """Tell a learner to reinstall the newest global fragment; retire its arrival."""

    learner: LearnerId
    fragment: FragmentIndex
    arrival: Arrival
    reason: str


@dataclass(frozen=True)
class Discard:
    """Retire an arrival that is older than one already merged (with a ``group``: its
    whole aggregate, whose sends its reducer forwards again)."""

    arrival: Arrival
    reason: str


@dataclass(frozen=True)
class Wait:
    """Nothing to do for this fragment yet; ``until`` is when to decide again, if known."""

    fragment: FragmentIndex
    reason: str
    until: float | None = None


Action = Merge | Resync | Discard | Wait

# ----------------------------------------------------------------------------- state


@dataclass(frozen=True)
class LearnerView:
    last_seen: float
    step_seconds: float | None = None
    state: str = "training"
    state_since: float = 0.0
    """When the syncer first saw the learner in ``state``."""

    @property
    def gone(self) -> bool:
        return self.state in GONE_STATES


@dataclass(frozen=True)
class FragmentRound:
    """One fragment's open round: what arrived since its last merge."""

    version: Version = Version(0)
    oldest_anchorable: Version = Version(0)
    pending: Mapping[LearnerId, tuple[Arrival, ...]] = field(default_factory=dict)
    """Per learner, its newest arrival from each base version, oldest first."""
    superseded: tuple[Arrival, ...] = ()
    opened_at: float | None = None
    quorum_at: float | None = None
    merging: Merge | None = None
    """The merge in flight, until it finishes or is aborted."""
    discarded_groups: frozenset[str] = frozenset()
    """Aggregates discarded in this round (their other arrivals are discarded too)."""


@dataclass(frozen=True)
class DecisionState:
    policy: DecisionPolicy
    learners: Mapping[LearnerId, LearnerView] = field(default_factory=dict)
    rounds: Mapping[FragmentIndex, FragmentRound] = field(default_factory=dict)
    merged_sequence: Mapping[tuple[LearnerId, FragmentIndex], int] = field(default_factory=dict)
    started_at: float = 0.0
    """When the syncer started deciding: learners not seen yet are presumed live for one
    liveness timeout after it, so a slow start does not lower the quorum."""
    quorum_seconds: float | None = None
    """EMA of xi_quorum."""
    sync_seconds: float | None = None
    """EMA of xi_sync."""

    def round(self, fragment: FragmentIndex) -> FragmentRound:
        return self.rounds.get(fragment, FragmentRound())

    def live_learners(self, now: float) -> frozenset[LearnerId]:
        """Learners seen within the liveness timeout that have not said they stopped."""
        timeout = self.policy.liveness_timeout_seconds
        return frozenset(
            learner for learner, view in self.learners.items() if is_live(view.state, view.last_seen, now, timeout)
        )

    def unseen_presumed_live(self, now: float) -> int:
        """How many of the M learners have never been seen but are still presumed live."""
        if now - self.started_at > self.policy.liveness_timeout_seconds:
            return 0
        return max(0, self.policy.num_learners - len(self.learners))

    def slowest_step_seconds(self, now: float) -> float:
        """xi_step: the slowest live learner's step time (0 while none is measured)."""
        times = [self.learners[m].step_seconds or 0.0 for m in self.live_learners(now)]
        return max(times, default=0.0)

    def effective_quorum(self, now: float) -> int:
        """K, lowered to the number of live learners (at least 1) so that dead learners
        cannot stall the run."""
        live = len(self.live_learners(now)) + self.unseen_presumed_live(now)
        return max(1, min(self.policy.quorum, live))

    def grace_seconds(self, now: float) -> float:
        """The grace window: ``gamma * max(0, tau*xi_step - xi_quorum - xi_sync)``, capped."""
        policy = self.policy
        budget = policy.overlap_steps * self.slowest_step_seconds(now)
        budget -= (self.quorum_seconds or 0.0) + (self.sync_seconds or 0.0)
        return min(policy.max_grace_seconds, policy.grace_gamma * max(0.0, budget))


def initial_state(
    policy: DecisionPolicy,
    now: float,
    versions: Mapping[FragmentIndex, tuple[Version, Version]] | None = None,
) -> DecisionState:
    """A fresh state at time ``now``; ``versions`` gives each fragment's (version, oldest
    anchorable base), and which fragments this syncer decides on (a syncer shard decides
    on its own); without it, every fragment from version 0."""
    if versions is None:
        versions = {FragmentIndex(p): (Version(0), Version(0)) for p in range(policy.num_fragments)}
    rounds = {fragment: FragmentRound(*versions[fragment]) for fragment in sorted(versions)}
    return DecisionState(policy=policy, rounds=rounds, started_at=now)


# ------------------------------------------------------------------------------ step


def _ema(previous: float | None, sample: float, weight: float) -> float:
    return sample if previous is None else (1 - weight) * previous + weight * sample


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def step(state: DecisionState, observations: Iterable[Observation], now: float) -> tuple[DecisionState, list[Action]]:
    """Fold observations into the state and decide, for every fragment, what to do now."""
    actions: list[Action] = []
    for observation in observations:
        state = _observe(state, observation, now, actions)
    for fragment in sorted(state.rounds):
        state = _decide(state, fragment, now, actions)
    return state, actions


def _seen(decisions: DecisionState, learner: LearnerId, now: float, **changes: object) -> DecisionState:
    view = decisions.learners.get(learner, LearnerView(last_seen=now))
    view = replace(view, last_seen=max(view.last_seen, now), **changes)
    return replace(decisions, learners={**decisions.learners, learner: view})


def _observe(state: DecisionState, observation: Observation, now: float, actions: list[Action]) -> DecisionState:
    weight = state.policy.ema_weight
    if isinstance(observation, HeartbeatSeen):
        previous = state.learners.get(observation.learner)
        step_seconds = previous.step_seconds if previous else None
        if observation.step_seconds is not None:
            step_seconds = _ema(step_seconds, observation.step_seconds, weight)
        since = previous.state_since if previous and previous.state == observation.state else now
        return _seen(
            state, observation.learner, now, step_seconds=step_seconds, state=observation.state, state_since=since
        )
    if isinstance(observation, MergeFinished):
        current = state.round(observation.fragment)
        merged = current.merging.arrivals if current.merging else ()
        if observation.merged_keys is not None:
            merged = tuple(a for a in merged if a.key in observation.merged_keys)
        sequences = {**state.merged_sequence, **{(a.learner, a.fragment): a.sequence for a in merged}}
        updated = replace(
            current, version=observation.version, oldest_anchorable=observation.oldest_anchorable, merging=None
        )
        return replace(
            state,
            rounds={**state.rounds, observation.fragment: updated},
            merged_sequence=sequences,
            sync_seconds=_ema(state.sync_seconds, observation.seconds, weight),
        )
    if isinstance(observation, MergeAborted):
        current = state.round(observation.fragment)
        aborted = current.merging
        restored = replace(
            current, merging=None, superseded=current.superseded + (aborted.superseded if aborted else ())
        )
        state = replace(state, rounds={**state.rounds, observation.fragment: restored})
        for arrival in aborted.arrivals if aborted else ():
            state = _observe_arrival(state, arrival, now, actions)
        return state
    if isinstance(observation, ResyncRequested):
        arrival = observation.arrival
        reason = (
            f"{arrival.learner} sent fragment {arrival.fragment} from base version {arrival.base_version}, "
            "older than its region's reducer can anchor; it must reinstall the newest global"
        )
        actions.append(Resync(arrival.learner, arrival.fragment, arrival, reason))
        return _seen(state, arrival.learner, now)
    return _observe_arrival(state, observation.arrival, now, actions)


def _discard_group(state: DecisionState, arrival: Arrival, reason: str, actions: list[Action]) -> DecisionState:
    """Discard an aggregate whole: this arrival of it, those of it already pending, and
    (through the round's ``discarded_groups``) those still to come."""
    current = state.round(arrival.fragment)
    actions.append(Discard(arrival, reason))
    pending = {
        learner: kept
        for learner, arrivals in current.pending.items()
        if (kept := tuple(a for a in arrivals if a.group != arrival.group))
    }
    updated = replace(current, pending=pending, discarded_groups=current.discarded_groups | {arrival.group})
    return replace(state, rounds={**state.rounds, arrival.fragment: updated})


def _observe_arrival(state: DecisionState, arrival: Arrival, now: float, actions: list[Action]) -> DecisionState:
    fragment, learner = arrival.fragment, arrival.learner
    if fragment not in state.rounds:
        actions.append(Discard(arrival, f"fragment {fragment} does not exist (P={state.policy.num_fragments})"))
        return state
    state = _seen(state, learner, now)  # an arrival shows it alive, whatever it last said
    current = state.round(fragment)
    pending = current.pending.get(learner, ())
    if any(old.key == arrival.key for old in (*pending, *current.superseded)):
        return state
    merged = state.merged_sequence.get((learner, fragment), -1)
    if arrival.group is not None:
        return _observe_grouped(state, arrival, merged, now, actions)
    if arrival.sequence <= merged:
        actions.append(
            Discard(
                arrival,
                f"{learner}'s send #{arrival.sequence} of fragment {fragment} is older than #{merged}, already merged",
            )
        )
        return state
    if not current.oldest_anchorable <= arrival.base_version <= current.version:
        where = (
            "older than the window" if arrival.base_version < current.oldest_anchorable else "newer than the syncer's"
        )
        actions.append(
            Resync(
                learner,
                fragment,
                arrival,
                f"{learner} sent fragment {fragment} from base version {arrival.base_version}, {where} "
                f"(anchorable {current.oldest_anchorable}..{current.version}); it must reinstall the newest global",
            )
        )
        return state
    same_base = [old for old in pending if old.base_version == arrival.base_version]
    if same_base and same_base[0].sequence > arrival.sequence:  # a late, older send of that base
        superseded, newest = current.superseded + (arrival,), pending
    else:
        others = [old for old in pending if old.base_version != arrival.base_version]
        superseded, newest = (
            current.superseded + tuple(same_base),
            tuple(sorted([*others, arrival], key=lambda a: a.sequence)),
        )
    opened_at = current.opened_at if current.opened_at is not None else now
    updated = replace(current, pending={**current.pending, learner: newest}, superseded=superseded, opened_at=opened_at)
    return replace(state, rounds={**state.rounds, fragment: updated})


def _observe_grouped(
    state: DecisionState, arrival: Arrival, merged: int, now: float, actions: list[Action]
) -> DecisionState:
    """An arrival in an aggregate: pending with its aggregate, or its aggregate discarded."""
    fragment, learner = arrival.fragment, arrival.learner
    current = state.round(fragment)
    if arrival.group in current.discarded_groups:
        actions.append(Discard(arrival, f"its aggregate {arrival.group} was discarded"))
        return state
    if arrival.anchor != current.version:
        reason = (
            f"aggregate {arrival.group} is anchored at version {arrival.anchor} of fragment {fragment}, "
            f"which is at {current.version} now; its reducer forwards its sends again"
        )
        return _discard_group(state, arrival, reason, actions)
    if arrival.sequence <= merged:
        reason = f"{learner}'s send #{arrival.sequence} of fragment {fragment} in it is older than #{merged}, merged"
        return _discard_group(state, arrival, f"aggregate {arrival.group}: {reason}", actions)
    pending = current.pending.get(learner, ())
    if any(old.base_version == arrival.base_version for old in pending):
        reason = f"{learner} already has a send of fragment {fragment} from base {arrival.base_version} pending"
        return _discard_group(state, arrival, f"aggregate {arrival.group}: {reason}", actions)
    newest = tuple(sorted([*pending, arrival], key=lambda a: a.sequence))
    opened_at = current.opened_at if current.opened_at is not None else now
    updated = replace(current, pending={**current.pending, learner: newest}, opened_at=opened_at)
    return replace(state, rounds={**state.rounds, fragment: updated})


def _decide(state: DecisionState, fragment: FragmentIndex, now: float, actions: list[Action]) -> DecisionState:
    current = state.round(fragment)
    if current.merging:
        actions.append(Wait(fragment, "a merge is in progress"))
        return state
    arrived = frozenset(current.pending)
    if not arrived:
        since = f"since its merge at version {current.version}" if current.version else "yet"
        actions.append(Wait(fragment, f"no arrivals {since}"))  # not "yet" once it merged
        return state
    live = state.live_learners(now)
    unseen = state.unseen_presumed_live(now)
    quorum = state.effective_quorum(now)
    policy = state.policy
    if len(arrived) < quorum:
        lowered = f" (lowered from {policy.quorum}: {len(live) + unseen} live)" if quorum < policy.quorum else ""
        actions.append(Wait(fragment, f"{len(arrived)} of K={quorum}{lowered} arrived; waiting"))
        return state
    if current.quorum_at is None:
        opened_at = current.opened_at if current.opened_at is not None else now
        state = replace(state, quorum_seconds=_ema(state.quorum_seconds, now - opened_at, policy.ema_weight))
        current = replace(current, quorum_at=now)
    missing = len(live - arrived) + unseen
    deadline = current.quorum_at + state.grace_seconds(now)
    if missing and now < deadline:
        actions.append(
            Wait(
                fragment,
                f"grace window: {deadline - now:.1f} s left for {_plural(missing, 'more learner')} "
                f"({len(arrived)} arrived)",
                until=deadline,
            )
        )
        return replace(state, rounds={**state.rounds, fragment: current})
    why = "every live learner arrived" if not missing else "the grace window ended"
    arrivals = tuple(
        sorted((a for group in current.pending.values() for a in group), key=lambda a: (a.learner, a.sequence))
    )
    merge = Merge(fragment, arrivals, current.superseded, f"merging {_plural(len(arrived), 'learner')}: {why}")
    actions.append(merge)
    fresh = FragmentRound(version=current.version, oldest_anchorable=current.oldest_anchorable, merging=merge)
    return replace(state, rounds={**state.rounds, fragment: fresh})


# --------------------------------------------------------------------------- the end


@dataclass(frozen=True)
class RunEnd:
    """Whether the run is over, and the learners it ended without."""

    over: bool
    given_up: Mapping[LearnerId, str]
    """Learners gone for at least ``give_up_seconds``, with why, in words."""


def run_end(state: DecisionState, learners: Iterable[LearnerId], now: float) -> RunEnd:
    """The run is over when every learner has finished, or has been gone (failed,
    stopped, or silent past the liveness timeout) for at least ``give_up_seconds``:
    a learner whose supervisor gave up must not hold the others' work hostage.

    A learner never heard from (a scheduler's job still queued, a host that never
    started it) holds up nobody once every learner heard from is done: it is given up
    as soon as it has been silent past the liveness timeout, without the further wait
    for a restart that a learner which trained gets."""
    policy = state.policy
    learners = list(learners)
    given_up: dict[LearnerId, str] = {}
    over = True
    never_heard: list[LearnerId] = []
    for learner in learners:
        view = state.learners.get(learner)
        if view is None:
            never_heard.append(learner)
            continue
        if view.state == "finished":
            continue
        silent_since = view.last_seen + policy.liveness_timeout_seconds
        if view.gone:
            gone_since, why = view.state_since, view.state
        elif now >= silent_since:
            gone_since, why = silent_since, "silent"
        else:
            over = False
            continue
        if now - gone_since >= policy.give_up_seconds:
            given_up[learner] = f"{why} for {now - gone_since:.0f} s"
        else:
            over = False
    silent_since = state.started_at + policy.liveness_timeout_seconds
    others_done = over and len(never_heard) < len(learners)
    for learner in never_heard:
        if now < silent_since:
            over = False
        elif others_done:
            given_up[learner] = f"never started ({now - state.started_at:.0f} s since the run began)"
        elif now - silent_since >= policy.give_up_seconds:
            given_up[learner] = f"silent for {now - silent_since:.0f} s"
        else:
            over = False
    return RunEnd(over=over, given_up=given_up)


# ----------------------------------------------------------------- a region wiped


def updates_to_restore(
    windows: Mapping[FragmentIndex, Iterable[Version]],
    listed: Iterable[tuple[Version, FragmentIndex]],
    bases: Mapping[FragmentIndex, Iterable[Version]],
) -> list[tuple[Version, FragmentIndex]]:
    """The updates a region whose bucket was wiped (its head and updates gone) needs
    again, in version order: those the head lists (``listed``), and of each fragment's
    window (its last W updates, ``windows``), every one after the oldest base the
    region's holders are known to have (``bases``: its learners' base versions and its
    reducer's copy), so that their next sends can be anchored and their copies catch
    up.  A fragment whose holders are not known gets its whole window back."""
    wanted = set(listed)
    for fragment, versions in windows.items():
        known = list(bases.get(fragment, ()))
        oldest = min(known) if known else None
        wanted |= {(version, fragment) for version in versions if oldest is None or version > oldest}
    return sorted(wanted)
