"""When the loops' periodic duties fall due, and when a run's end is near."""

from types import SimpleNamespace

from diloco_cli.core.cadence import Cadences, due_to_finish
from diloco_cli.store.documents import LearnerState


def report(state, step, total=100, step_seconds=0.5, time=1000.0):
    return SimpleNamespace(state=state, step=step, total_steps=total, step_seconds=step_seconds, time=time)


def test_a_learner_is_due_to_finish_once_its_remaining_steps_have_had_their_time():
    """90 of 100 steps at 0.5 s a step, reported at t=1000: due at 1005."""
    going = report(LearnerState.TRAINING, 90)
    assert not due_to_finish([going], 1004.9)
    assert due_to_finish([going], 1005.0) and due_to_finish([report("training", 90)], 1005.1)
    assert not due_to_finish([report(LearnerState.FINISHED, 100), report(LearnerState.FAILED, 10)], 2000.0)
    assert not due_to_finish([report(LearnerState.TRAINING, 10, step_seconds=None)], 9e9)  # no step time yet
    assert due_to_finish([report(LearnerState.FINISHED, 100), going], 1006.0)  # any one of them


def test_a_task_is_due_at_first_and_then_every_period():
    cadences = Cadences("beats")
    assert cadences.due("beats", 0.0, 5.0)
    assert not cadences.due("beats", 4.9, 5.0)
    assert cadences.due("beats", 5.0, 5.0) and not cadences.due("beats", 6.0, 5.0)
