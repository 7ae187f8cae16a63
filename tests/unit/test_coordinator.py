"""The skeleton the syncer and the reducers share (fake clocks, no storage)."""

import logging
import time
from dataclasses import dataclass, replace

from diloco_cli.codec import PayloadError
from diloco_cli.core.cadence import Cadences
from diloco_cli.core.heartbeats import Heartbeats
from diloco_cli.runtime import coordinator
from diloco_cli.runtime.coordinator import (
    EXIT_FINISHED,
    EXIT_STOPPED,
    Liveness,
    RefusalCount,
    heartbeats_due,
    run_turns,
    take_in_heartbeat,
)

log = logging.getLogger("test")


@dataclass(frozen=True)
class Beat:
    state: str
    epoch: int
    time: float
    step: int = 0
    total_steps: int = 100
    step_seconds: float | None = None

    def as_heard(self, earlier):
        return replace(self, state=earlier.state)


def test_the_same_refusal_is_counted_again_only_after_the_repeat_window(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(coordinator.time, "time", lambda: now[0])
    once = RefusalCount(log, repeat_seconds=10.0)
    every_time = RefusalCount(log)
    for count in (once, every_time):
        count.refused("update", "global/updates/1.dlc", PayloadError("damaged"))
        count.refused("update", "global/updates/1.dlc", PayloadError("damaged"))
        count.refused("update", "global/updates/1.dlc", PayloadError("another reason"))
    assert once.refusals.counts == {"update": 2} and every_time.refusals.counts == {"update": 3}
    now[0] += 10.0
    once.refused("update", "global/updates/1.dlc", PayloadError("damaged"))
    assert once.refusals.counts == {"update": 3}


def test_a_heartbeat_taken_in_is_news_once_and_a_replay_is_refused_once():
    heard, refused = Heartbeats(), []

    def refuse(kind, key, error):
        refused.append((kind, key))

    assert take_in_heartbeat(heard, "a", None, refuse) is None
    assert take_in_heartbeat(heard, "a", PayloadError("tag mismatch"), refuse) is None
    assert refused == [("heartbeat", "heartbeats/a.json")]
    assert take_in_heartbeat(heard, "a", Beat("training", 1, 10.0), refuse).news
    assert not take_in_heartbeat(heard, "a", Beat("training", 1, 10.0), refuse).news  # read again
    for _ in range(3):
        replay = take_in_heartbeat(heard, "a", Beat("training", 1, 5.0), refuse)
        assert replay.replay is not None and not replay.news
    assert len(refused) == 2 and heard.newest["a"].time == 10.0


def test_liveness_a_learner_gone_or_silent_may_not_send_one_unheard_only_while_the_reader_is_young():
    liveness = Liveness(started_at=0.0)
    assert liveness.live(["a", "b"], now=59.0, timeout_seconds=60.0) == {"a", "b"}
    assert not liveness.heard("a", "training", now=50.0)
    assert liveness.live(["a", "b"], now=61.0, timeout_seconds=60.0) == {"a"}  # b never heard from
    assert liveness.live(["a"], now=111.0, timeout_seconds=60.0) == set()  # a silent too long
    assert liveness.heard("a", "finished", now=112.0)  # it stopped going on
    assert not liveness.heard("a", "finished", now=113.0)
    assert liveness.live(["a"], now=113.0, timeout_seconds=60.0) == set()


def test_heartbeats_are_read_every_period_and_more_often_once_a_learner_is_due_to_finish():
    cadences = Cadences("beats", "ending")
    wall = time.time()
    going = [Beat("training", 1, wall, step=10, total_steps=100, step_seconds=1.0)]
    assert heartbeats_due(cadences, 0.0, 30.0, going)
    assert not heartbeats_due(cadences, 6.0, 30.0, going)  # due to finish in 90 s
    due = [Beat("training", 1, wall, step=100, total_steps=100, step_seconds=1.0)]
    assert heartbeats_due(cadences, 6.0, 30.0, due) and not heartbeats_due(cadences, 7.0, 30.0, due)


class Turner:
    def __init__(self, turns_to_finish):
        self.turns, self.turns_to_finish, self.finished = 0, turns_to_finish, False

    def turn(self):
        self.turns += 1
        self.finished = self.turns >= self.turns_to_finish
        return 0.0


class Stop:
    def __init__(self, after_turns, turner):
        self.after_turns, self.turner = after_turns, turner

    @property
    def requested(self):
        return self.turner.turns >= self.after_turns


def test_run_turns_until_every_coordinator_finished_or_a_signal_stops_them():
    quick, slow = Turner(1), Turner(3)
    assert run_turns([quick, slow], lambda: 0.0, Stop(10, slow)) == EXIT_FINISHED
    assert (quick.turns, slow.turns) == (1, 3)  # a finished one turns no more
    endless = Turner(10)
    assert run_turns([endless], lambda: 0.0, Stop(2, endless)) == EXIT_STOPPED and endless.turns == 2
