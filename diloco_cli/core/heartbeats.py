"""Which of a learner's heartbeats is news, and whether the learner is live, for every
reader that decides liveness.

A heartbeat is sealed with the run's key, so a copy of an older one put back over the
newest (a replay) is authentic.  Taken as news, it would bring a finished learner back
to life: the syncer and the reducers would wait for it, and ``diloco status`` would show
it training.  So heartbeats are ordered by (epoch, time): the epoch counts the learner's
starts, so a resumed learner whose step (or whose host's clock) went back is still
heard, and within one start a heartbeat older than one already taken in is refused as a
replay, as a learner refuses a head older than one it has seen.  A learner whose region's
bucket was wiped loses its count of starts (it is kept there) and starts again from 1:
once a reader knows (:meth:`Heartbeats.lose_starts`), a heartbeat of a lower start that
is newer than every one taken in is heard (a replay is a copy of one written before, so
never newer).  Within one start a
learner that stopped going on (finished, stopped, failed) never goes on again: it
writes nothing after its last heartbeat, so a later one saying otherwise is refused too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

GONE_STATES = frozenset({"finished", "stopped", "failed"})
"""Learner states in which it will send nothing more until it is started again."""


def is_live(state: str, last_seen: float, now: float, timeout_seconds: float) -> bool:
    """Whether a learner last seen in ``state`` at ``last_seen`` may still send at ``now``:
    it has not said it stopped, and was heard from within the liveness timeout (the
    syncer's decisions and the reducers judge liveness alike)."""
    return state not in GONE_STATES and now - last_seen <= timeout_seconds


class Beat(Protocol):
    """What a heartbeat says of its order."""

    @property
    def state(self) -> Any: ...  # a state's ``value``, or the state's name itself

    epoch: int
    time: float

    def as_heard(self, earlier: Any) -> Any:
        """This heartbeat standing where ``earlier`` (an earlier start's record) does."""
        ...


def _state(beat: Beat) -> str:
    return getattr(beat.state, "value", beat.state)


def replay_reason(seen: Beat | None, beat: Beat, starts_lost: bool = False) -> str | None:
    """Why ``beat`` cannot come after ``seen``, the newest heartbeat taken in from the
    same learner (None when it can: newer, or the same one read again; with
    ``starts_lost``, also a lower start's heartbeat newer than ``seen``)."""
    if seen is None:
        return None
    if starts_lost and beat.epoch < seen.epoch and beat.time > seen.time:
        return None
    if (beat.epoch, beat.time) < (seen.epoch, seen.time):
        return (
            f"a replayed heartbeat: {_state(beat)} in start {beat.epoch} at {beat.time:.3f} is older than "
            f"{_state(seen)} in start {seen.epoch} at {seen.time:.3f}, seen before"
        )
    if beat.epoch == seen.epoch and _state(seen) in GONE_STATES and _state(beat) not in GONE_STATES:
        return (
            f"a replayed heartbeat: {_state(beat)} after {_state(seen)} in the same start ({beat.epoch}); "
            "a learner goes on again only in a new start"
        )
    return None


@dataclass(frozen=True)
class Heard:
    """What one heartbeat read told its reader."""

    news: bool
    """Newer than the one taken in before (liveness, state, progress)."""
    replay: str | None = None
    """Why it was refused as a replay (None: it was taken in)."""
    counted_before: bool = False
    """This replay was refused at an earlier read already: a reader counts it once,
    however often it reads it again."""


BeatType = TypeVar("BeatType", bound=Beat)


@dataclass
class Heartbeats(Generic[BeatType]):
    """A reader's newest heartbeat of each learner, taken in by (epoch, time)."""

    newest: dict[str, BeatType] = field(default_factory=dict)
    """Per learner, the newest heartbeat taken in."""
    earlier: dict[str, Beat] = field(default_factory=dict)
    """Per learner, the newest heartbeat the reader's earlier start had taken in (from its
    status): a restarted reader refuses a replay older than it too."""
    refused: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Per learner, the (epoch, time) of the replay last refused."""
    starts_lost: set[str] = field(default_factory=set)
    """Learners whose count of starts was lost with their region's bucket, until one of
    their heartbeats of a lower start is taken in."""

    recounted: dict[str, float] = field(default_factory=dict)
    """Per learner whose starts were counted again, the time of its first heartbeat so
    counted: any heartbeat older is from before the wipe, whatever its start (a replay)."""

    def lose_starts(self, learners: Iterable[str]) -> None:
        """These learners' region lost its bucket (wiped and made again), with their count
        of starts: their next start counts from 1 again and is heard all the same."""
        self.starts_lost.update(learners)

    def hear(self, learner: str, beat: BeatType) -> Heard:
        """Take ``beat`` in unless it is a replay; say whether it was news (the first one
        a start of the reader takes in always is).  A replay met first after a restart
        leaves the learner where the earlier start heard it: finished stays finished,
        though the learner, finished, writes no heartbeat to replace the replay."""
        seen = self.newest.get(learner)
        earlier = self.earlier.get(learner) if seen is None else None
        reason = replay_reason(seen or earlier, beat, learner in self.starts_lost)
        recounted = self.recounted.get(learner)
        if reason is None and recounted is not None and beat.time < recounted:
            reason = (
                f"a replayed heartbeat: {_state(beat)} in start {beat.epoch} at {beat.time:.3f} is from before "
                f"the learner's starts were counted again at {recounted:.3f} (its region's bucket was wiped)"
            )
        if reason is not None:
            counted_before = self.refused.get(learner) == (beat.epoch, beat.time)
            self.refused[learner] = (beat.epoch, beat.time)
            if earlier is not None:
                self.newest[learner] = beat.as_heard(earlier)
            return Heard(news=earlier is not None, replay=reason, counted_before=counted_before)
        if seen is not None and beat.epoch < seen.epoch:
            self.starts_lost.discard(learner)
            self.recounted[learner] = beat.time
        self.newest[learner] = beat
        return Heard(news=seen is None or (seen.epoch, seen.time) != (beat.epoch, beat.time))
