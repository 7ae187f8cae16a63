"""The skeleton both coordinators turn in: the syncer and a region's reducer.

Each is a loop of turns over object storage that decides with a pure core
(:mod:`diloco_cli.core.decisions`, :mod:`diloco_cli.core.reducer_step`).  What they share
lives here once:

* **the run loop and its exit codes**: :func:`run_turns` turns until every coordinator
  in the process finished (:data:`EXIT_FINISHED`) or SIGTERM or SIGINT asked it to stop
  after the turn under way (:class:`StopSignals`, :data:`EXIT_STOPPED`);
* **when to read heartbeats**: :func:`heartbeats_due`, every few seconds and more often
  once a learner is due to finish;
* **taking a heartbeat in**: :func:`take_in_heartbeat`, replays refused (and counted
  once however often they are read again);
* **liveness**: :class:`Liveness`, who may still send, from the heartbeats taken in;
* **counting refusals**: :class:`RefusalCount`, logged and counted in the status's
  :class:`~diloco_cli.store.documents.Refusals`, the same one at most every
  :data:`REPEAT_SECONDS` where a coordinator meets it every turn;
* **following the manifest**: :func:`same_run`, a manifest rewritten by ``diloco
  scale`` taken in while it still describes this run.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from diloco_cli.codec import PayloadError
from diloco_cli.core.cadence import END_READ_SECONDS, Cadences, Progress, due_to_finish
from diloco_cli.core.heartbeats import GONE_STATES, Heard, Heartbeats, is_live
from diloco_cli.core.types import LearnerId
from diloco_cli.store.documents import Heartbeat, Refusals
from diloco_cli.store.region import heartbeat_key
from diloco_cli.store.run_spec import RunSpec

log = logging.getLogger("diloco.coordinator")

EXIT_FINISHED = 0
"""A coordinator's exit status once the run is over and it holds nothing."""
EXIT_STOPPED = 143
"""A coordinator's exit status when a signal stopped it (128 + SIGTERM)."""
REPEAT_SECONDS = 10.0
"""The same refusal (object and reason) is logged and counted again at most this often
where a coordinator meets it every turn (a damaged update, until the syncer rewrites it)."""

# --------------------------------------------------------------------------- the loop


class StopSignals:
    """SIGTERM and SIGINT ask the process to stop after the turn under way."""

    def __init__(self, after: str, logger: logging.Logger = log) -> None:
        self.after, self.log = after, logger
        """What is finished before stopping, for the log ("the current merge"); the
        coordinator's log."""
        self.requested = False
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum: int, _frame: Any) -> None:
        self.log.info("signal %d: stopping after %s", signum, self.after)
        self.requested = True


class Coordinator(Protocol):
    finished: bool

    def turn(self) -> float:
        """One turn; when to wake for the next (its clock)."""
        ...


def run_turns(coordinators: Sequence[Coordinator], clock: Callable[[], float], stop: StopSignals) -> int:
    """Turn every coordinator not finished, then sleep until the earliest asks to be woken,
    until all finished (:data:`EXIT_FINISHED`) or a signal asked to stop
    (:data:`EXIT_STOPPED`: the caller reports it)."""
    while not stop.requested:
        wake = min(coordinator.turn() for coordinator in coordinators if not coordinator.finished)
        if all(coordinator.finished for coordinator in coordinators):
            return EXIT_FINISHED
        time.sleep(max(0.0, wake - clock()))
    return EXIT_STOPPED


def heartbeats_due(cadences: Cadences, now: float, every: float, progress: Iterable[Progress]) -> bool:
    """Whether to read heartbeats at ``now``: every ``every`` seconds, and every
    :data:`END_READ_SECONDS` once a learner is due to finish (a run ends within seconds
    of its learners); ``cadences`` holds the tasks ``beats`` and ``ending``."""
    return cadences.due("beats", now, every) or (
        due_to_finish(progress, time.time()) and cadences.due("ending", now, END_READ_SECONDS)
    )


# ------------------------------------------------------------------------- refusals


class RefusalCount:
    """Objects a coordinator refused: logged, and counted in ``refusals`` (its status's)."""

    def __init__(
        self,
        logger: logging.Logger,
        refusals: Refusals | None = None,
        where: str = "",
        repeat_seconds: float = 0.0,
    ) -> None:
        self.log = logger
        self.refusals = refusals if refusals is not None else Refusals()
        self.where = where
        """Where the objects are, for the log (" in region east"), if it does not go without saying."""
        self.repeat_seconds = repeat_seconds
        """The same refusal within this long of the last is neither logged nor counted again."""
        self._last: dict[tuple[str, str, str], float] = {}

    def refused(self, kind: str, key: str, error: Exception) -> None:
        reason, now = str(error), time.time()
        if self.repeat_seconds > 0:
            self._last = {seen: at for seen, at in self._last.items() if now - at < self.repeat_seconds}
            if (kind, key, reason) in self._last:
                return
            self._last[(kind, key, reason)] = now
        self.log.warning("refusing %s %s%s: %s", kind, key, self.where, reason)
        self.refusals.record(kind, key, reason, now)


# ------------------------------------------------------------------------ heartbeats


def take_in_heartbeat(
    heard: Heartbeats[Heartbeat],
    learner: LearnerId,
    beat: Heartbeat | PayloadError | None,
    refused: Callable[[str, str, Exception], None],
) -> Heard | None:
    """Take in a learner's heartbeat as read (an error: refused; None: none written yet):
    a replay is refused, once however often it is read again.  What it told (None when
    nothing was taken in)."""
    if isinstance(beat, PayloadError):
        refused("heartbeat", heartbeat_key(learner), beat)
        return None
    if beat is None:
        return None
    told = heard.hear(learner, beat)
    if told.replay is not None and not told.counted_before:
        refused("heartbeat", heartbeat_key(learner), PayloadError(told.replay))
    return told


class Liveness:
    """Who may still send, from the heartbeats taken in: a learner not gone (finished,
    stopped, failed) whose heartbeat changed within ``timeout_seconds``; one not heard
    from yet is presumed live while the reader is young (a slow start is no death)."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.changed_at: dict[LearnerId, float] = {}
        """Per learner, when its newest heartbeat was taken in (the reader's clock)."""
        self.states: dict[LearnerId, str] = {}

    def heard(self, learner: LearnerId, state: str, now: float) -> bool:
        """A new heartbeat of ``learner`` in ``state``; whether it stopped going on with it."""
        was_going = self.states.get(learner) not in GONE_STATES
        self.states[learner], self.changed_at[learner] = state, now
        return was_going and state in GONE_STATES

    def live(self, learners: Iterable[LearnerId], now: float, timeout_seconds: float) -> set[LearnerId]:
        """Of ``learners``, those that may still send at ``now``."""
        live = set()
        for learner in learners:
            if learner not in self.states:
                if now - self.started_at < timeout_seconds:
                    live.add(learner)
            elif is_live(self.states[learner], self.changed_at[learner], now, timeout_seconds):
                live.add(learner)
        return live


# -------------------------------------------------------------------------- manifest


def same_run(spec: RunSpec | None, current: RunSpec) -> RunSpec | None:
    """A manifest read again (``diloco scale``, ``diloco chaos``), when it still describes
    the run ``current`` does; one of another run is ignored, with a warning."""
    if spec is not None and (spec.run, spec.created) != (current.run, current.created):
        log.warning("the manifest now describes another run (%s); ignoring it", spec.run)
        return None
    return spec
