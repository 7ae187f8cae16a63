"""Replayed heartbeats are refused and counted, by every reader that decides liveness
(issue 31, point 4): heartbeats are ordered by (epoch, time), and within one start a
learner that stopped going on never goes on again; a resumed learner (a new epoch) is
heard even when its step and its host's clock went back.  The rule itself is pure
(diloco_cli/core/heartbeats.py); the syncer and a region's reducer read real sealed
heartbeats over a file:// bucket (tests/support/harness.py)."""

from dataclasses import dataclass

import pytest

from diloco_cli.core.heartbeats import Heartbeats, replay_reason
from diloco_cli.runtime.reducer.loop import Reducer
from diloco_cli.runtime.syncer.loop import Syncer
from diloco_cli.store.documents import LearnerState, SyncerPhase
from diloco_cli.store.region import heartbeat_key
from diloco_cli.views.run_state import collect_status
from tests.support.harness import Harness


@dataclass
class Beat:
    state: str
    epoch: int
    time: float


def test_a_heartbeat_older_than_one_seen_is_a_replay_and_a_new_start_is_heard():
    finished = Beat("finished", epoch=1, time=200.0)
    assert replay_reason(None, finished) is None
    assert replay_reason(finished, finished) is None  # the same one, read again
    assert "replayed heartbeat" in replay_reason(finished, Beat("training", 1, 150.0))
    assert "replayed heartbeat" in replay_reason(finished, Beat("finished", 1, 150.0))
    assert "same start" in replay_reason(finished, Beat("training", 1, 250.0))  # finished never goes back
    assert replay_reason(Beat("training", 1, 100.0), Beat("finished", 1, 150.0)) is None
    assert replay_reason(finished, Beat("training", 2, 120.0)) is None  # resumed, its host's clock behind
    assert replay_reason(Beat("training", 2, 120.0), finished) is not None  # the old start's, put back


def test_a_replay_is_refused_each_time_it_is_read_but_counted_once():
    heard = Heartbeats()
    assert heard.hear("a", Beat("training", 1, 100.0)).news
    assert heard.hear("a", Beat("finished", 1, 200.0)).news
    assert not heard.hear("a", Beat("finished", 1, 200.0)).news
    first, again = (heard.hear("a", Beat("training", 1, 100.0)) for _ in range(2))
    assert first.replay and not first.counted_before and again.replay and again.counted_before
    assert heard.newest["a"].state == "finished"
    assert heard.hear("a", Beat("training", 2, 50.0)).news and heard.newest["a"].epoch == 2


def test_a_learner_whose_region_was_wiped_counts_its_starts_again_and_is_heard():
    """Its count of starts is kept in its region's bucket: wiped, the learner's next
    start is 1 again.  Refused as a replay, it was never heard again and the run never
    ended (the chaos test's wipe after a learner's kill).  Once the reader knows of the
    wipe, a lower start newer than every heartbeat taken in is heard; replays are not."""
    heard = Heartbeats()
    assert heard.hear("a", Beat("training", 3, 100.0)).news
    assert heard.hear("a", Beat("training", 1, 150.0)).replay  # before the reader knows of the wipe
    heard.lose_starts(["a"])
    assert heard.hear("a", Beat("training", 2, 90.0)).replay  # older than the newest taken in: a replay
    told = heard.hear("a", Beat("training", 1, 160.0))
    assert told.news and told.replay is None and heard.newest["a"].epoch == 1 and "a" not in heard.starts_lost
    assert heard.hear("a", Beat("finished", 1, 200.0)).news
    assert heard.hear("a", Beat("training", 1, 210.0)).replay  # finished never goes back in the new count
    assert heard.hear("a", Beat("training", 3, 100.0)).replay  # the old count's, put back


def replay(bucket, learner, old: bytes) -> None:
    """Put an authentic older heartbeat of ``learner`` back over its newest."""
    bucket.store.put(heartbeat_key(learner), old)


def test_the_syncer_refuses_a_replayed_training_heartbeat_and_ends_the_run_with_every_learner(harness):
    """An authentic "training" heartbeat copied back over a finished learner's was taken
    as news: the syncer counted the learner live again and ended the run "without" it,
    late by the liveness timeout plus give_up_seconds."""
    done, other = harness.learners
    for learner in harness.learners:
        harness.train(learner, learner.total_steps)
    harness.merge()
    done.heartbeats.beat(LearnerState.TRAINING, wait=10)
    training = harness.bucket.store.get(heartbeat_key(done.me.id))
    assert done.finish() == 0
    syncer = harness.syncer
    syncer.turn(read_heartbeats=True)
    harness.reducer.turn(read_heartbeats=True)  # the replay comes once both took in the final heartbeat
    assert syncer.observer.heartbeats[done.me.id].state is LearnerState.FINISHED
    replay(harness.bucket, done.me.id, training)
    for _ in range(3):
        syncer.turn(read_heartbeats=True)
    assert syncer.observer.heartbeats[done.me.id].state is LearnerState.FINISHED
    assert done.me.id not in syncer.decisions.live_learners(syncer.clock())
    refusals = syncer.observer.refusals["east"]
    assert refusals.counts == {"heartbeat": 1} and "replayed heartbeat" in refusals.latest.reason
    # `diloco status` reads the heartbeat itself: it refuses it too, and shows the learner finished
    syncer.write_status(SyncerPhase.RUNNING)
    status = collect_status(harness.spec, harness.secret)
    assert next(row for row in status.learners if row.learner == done.me.id).state == "finished"
    assert "replayed heartbeat" in status.regions[0].latest_refusal["reason"]
    assert other.finish() == 0
    for _ in range(20):
        harness.reducer.turn(read_heartbeats=True)  # relays the last sends
        syncer.turn(read_heartbeats=True)
        if syncer.finished:
            break
    assert syncer.finished and syncer.given_up == {}


@pytest.fixture
def reduced(tmp_path, secret):
    made = Harness(tmp_path, secret)
    yield made
    made.close()


def test_a_reducer_refuses_a_replayed_heartbeat_and_hears_the_learners_next_start(reduced):
    learner = reduced.learners[0]
    reducer = reduced.reducer
    learner.heartbeats.beat(LearnerState.TRAINING, wait=10)
    training = reduced.bucket.store.get(heartbeat_key(learner.me.id))
    learner.heartbeats.beat(LearnerState.FINISHED, wait=10)
    finished = reduced.bucket.read_heartbeat(learner.me.id)
    reducer.turn(read_heartbeats=True)
    assert learner.me.id not in reducer._live()
    replay(reduced.bucket, learner.me.id, training)
    for _ in range(3):
        reducer.turn(read_heartbeats=True)
    assert learner.me.id not in reducer._live()
    assert reducer.status().heartbeats_seen[learner.me.id] == finished.time
    assert reducer.refusals.counts == {"heartbeat": 1} and "replayed heartbeat" in reducer.refusals.latest.reason
    # resumed on a host whose clock is behind, from an earlier step: a new start, heard
    resumed = finished.model_copy(
        update={"state": LearnerState.TRAINING, "epoch": finished.epoch + 1, "step": 3, "time": finished.time - 60}
    )
    reduced.bucket.write_heartbeat(resumed)
    reducer.turn(read_heartbeats=True)
    assert learner.me.id in reducer._live()
    assert reducer.status().heartbeats_seen[learner.me.id] == resumed.time
    assert reducer.refusals.counts == {"heartbeat": 1}


def test_a_restarted_syncer_and_reducer_refuse_a_replay_older_than_what_they_heard_before(reduced, secret):
    """A coordinator killed after it heard a learner finish refuses, once restarted, an
    older heartbeat put back: else the restarted reducer would report the replay's time
    as seen and the syncer, waiting for it to see the finished one, never end the run."""
    learner = reduced.learners[0]
    learner.heartbeats.beat(LearnerState.TRAINING, wait=10)
    training = reduced.bucket.store.get(heartbeat_key(learner.me.id))
    learner.heartbeats.beat(LearnerState.FINISHED, wait=10)
    finished = reduced.bucket.read_heartbeat(learner.me.id)
    reduced.reducer.turn(read_heartbeats=True)
    reduced.syncer.turn(read_heartbeats=True)
    reduced.reducer._write_status()
    reduced.syncer.write_status(SyncerPhase.RUNNING)
    syncer, reducer = Syncer(reduced.spec, secret), Reducer(reduced.spec, "east", secret)  # both "killed", restarted
    syncer.start()
    reducer.start()
    replay(reduced.bucket, learner.me.id, training)
    reducer.turn(read_heartbeats=True)
    syncer.turn(read_heartbeats=True)
    assert learner.me.id not in reducer._live()
    assert learner.me.id not in syncer.decisions.live_learners(syncer.clock())
    assert reducer.refusals.counts == {"heartbeat": 1} and syncer.observer.refusals["east"].counts == {"heartbeat": 1}
    # both hold the learner where they heard it before: finished, at its last heartbeat's time
    assert syncer.observer.heartbeats[learner.me.id].state is LearnerState.FINISHED
    assert reducer.status().heartbeats_seen[learner.me.id] == syncer.observer.heartbeats[learner.me.id].time
    assert syncer.observer.heartbeats[learner.me.id].time == finished.time
    learner.heartbeats.beat(LearnerState.FINISHED, wait=10)  # the learner's own, newer: heard by both
    reducer.turn(read_heartbeats=True)
    syncer.turn(read_heartbeats=True)
    newest = reduced.bucket.read_heartbeat(learner.me.id)
    assert newest.time > finished.time
    assert reducer.status().heartbeats_seen[learner.me.id] == syncer.observer.heartbeats[learner.me.id].time
