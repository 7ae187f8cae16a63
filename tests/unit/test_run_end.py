"""When the syncer ends a run: every learner finished (or given up) and nothing left to
merge, in the buckets too.  Driven step by step over a file:// bucket with the tampering
harness; a storage failure is injected into one scan."""

import time

from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import tokens_merged


def test_a_scan_cut_short_by_a_storage_failure_does_not_end_the_run_before_the_last_payloads(harness, monkeypatch):
    """A scan stops at the first payload it cannot read (the rest wait for a later
    turn).  When that happens after every learner reported finished, the syncer has not
    seen their last payloads: ending the run then lost them (seen with a flaky S3
    endpoint: one learner's final send, 95% of its tokens, never merged)."""
    learners = harness.learners
    total = learners[0].total_steps
    for learner in learners:
        harness.train(learner, total)
    harness.merge()  # everything sent so far is merged; the final sends come with finish
    for learner in learners:
        assert learner.finish() == 0
    harness.reducer.turn(read_heartbeats=True)  # relays the final sends
    bucket = harness.syncer.buckets["east"]
    unread = bucket.relay_keys()
    assert unread, "finishing sends what was trained since the last sends"
    read_marker = bucket.payload_record

    def failing(key):
        raise StorageError(f"reading {key} failed after 3 tries: Service Unavailable")

    monkeypatch.setattr(bucket, "payload_record", failing)
    harness.syncer.turn(read_heartbeats=True)
    assert not harness.syncer.finished, "the run ended while payloads it could not read were waiting"
    monkeypatch.setattr(bucket, "payload_record", read_marker)
    for _ in range(20):
        harness.syncer.turn(read_heartbeats=True)
        harness.reducer.turn(read_heartbeats=True)
        if harness.syncer.finished:
            break
    assert harness.syncer.finished
    history = harness.syncer.home.history()
    for learner in learners:
        beat = bucket.read_heartbeat(learner.me.id)
        for fragment in range(len(learner.fragment_list)):
            merged = tokens_merged(history, learner.me.id, fragment)
            assert merged + beat.tokens_overwritten.get(fragment, 0) == beat.tokens, (learner.me.id, fragment)


def test_once_a_learner_is_due_to_finish_the_syncer_reads_heartbeats_every_few_seconds(harness, monkeypatch):
    """With heartbeats every 30 s a run ended up to a period after its learners; once a
    learner's last report says its remaining steps have had their time, the syncer reads
    heartbeats every END_READ_SECONDS (its clock moved by hand here)."""
    from diloco_cli.core.cadence import END_READ_SECONDS
    from diloco_cli.store.documents import LearnerState

    syncer, learner = harness.syncer, harness.learners[0]
    now = [1000.0]
    syncer.clock = lambda: now[0]
    training = syncer.recipe.training.model_copy(update={"heartbeat_seconds": 3600.0})
    sync = syncer.recipe.sync.model_copy(update={"status_seconds": 3600.0})
    syncer.recipe = syncer.recipe.model_copy(update={"training": training, "sync": sync})
    harness.train(learner, 2)  # a step time to tell
    learner.heartbeats.beat(LearnerState.TRAINING, wait=10)
    syncer.turn()  # the first read: heartbeats are due at first
    seen = syncer.observer.heartbeats[learner.me.id]
    assert seen.state is LearnerState.TRAINING and seen.step < seen.total_steps and seen.step_seconds
    learner.heartbeats.beat(LearnerState.FINISHED, wait=10)
    now[0] += END_READ_SECONDS
    syncer.turn()
    assert syncer.observer.heartbeats[learner.me.id].state is LearnerState.TRAINING  # not due yet: an hour's period
    remaining = (seen.total_steps - seen.step) * (seen.step_seconds or 0.0)
    monkeypatch.setattr("time.time", lambda: seen.time + remaining + 0.1)  # its steps have had their time
    now[0] += END_READ_SECONDS
    syncer.turn()
    assert syncer.observer.heartbeats[learner.me.id].state is LearnerState.FINISHED


def test_a_learner_never_started_holds_up_nobody_and_trains_nothing_when_it_starts_after_the_end(tmp_path, secret):
    """A Slurm job still queued when the others finished: the run ends once it has been
    silent past the liveness timeout (not the give-up time as well), saying why; when
    the job starts after all, its learner sees the finished head, trains nothing and leaves."""
    from diloco_cli.runtime.coordinator import EXIT_FINISHED
    from tests.support.harness import Harness

    harness = Harness(tmp_path, secret, started=("east-0",), liveness_timeout_seconds=0.5, give_up_seconds=3600)
    try:
        (learner,) = harness.learners
        harness.train(learner, learner.total_steps)
        assert learner.finish() == EXIT_FINISHED
        time.sleep(0.6)  # east-1 silent past the liveness timeout since the run began
        for _ in range(20):
            harness.reducer.turn(read_heartbeats=True)
            harness.syncer.turn(read_heartbeats=True)
            if harness.syncer.finished:
                break
        assert harness.syncer.finished, "a learner never heard from held up the end"
        assert set(harness.syncer.given_up) == {"east-1"} and "never started" in harness.syncer.given_up["east-1"]
        late = harness.learner("east-1")
        assert late.leaving and late.step == 0
        assert late.finish() == EXIT_FINISHED and late.step == 0  # it left as a drained learner does
        beat = harness.bucket.read_heartbeat("east-1")
        assert beat.state.value == "finished" and beat.tokens == 0
    finally:
        harness.close()
