"""The syncer's decision state machine, driven by a fake clock."""

from dataclasses import replace

import pytest

from diloco_cli.core.decisions import (
    Arrival,
    ArrivalSeen,
    DecisionPolicy,
    Discard,
    HeartbeatSeen,
    Merge,
    MergeAborted,
    MergeFinished,
    Resync,
    ResyncRequested,
    Wait,
    initial_state,
    run_end,
    step,
)
from diloco_cli.core.types import FragmentIndex, LearnerId, Version

P0 = FragmentIndex(0)


def arrival(learner, sequence=1, base=0, fragment=0, steps=10, tokens=1000):
    return Arrival(
        learner=LearnerId(learner),
        fragment=FragmentIndex(fragment),
        base_version=Version(base),
        c_steps=steps,
        c_tokens=tokens,
        sequence=sequence,
        key=f"{learner}/{fragment}/{sequence}",
    )


def heartbeats(*learners, step_seconds=1.0):
    return [HeartbeatSeen(LearnerId(m), step_seconds) for m in learners]


def policy(**overrides):
    values = dict(num_learners=3, quorum=2, num_fragments=1, grace_gamma=0.5, overlap_steps=4.0, max_grace_seconds=10.0)
    values.update(overrides)
    return DecisionPolicy(**values)


def only(actions, kind):
    found = [a for a in actions if isinstance(a, kind)]
    assert len(found) == 1, actions
    return found[0]


def test_waits_for_quorum_then_merges_when_every_live_learner_arrived():
    state = initial_state(now=0.0, policy=policy(quorum=3, num_learners=3))
    state, actions = step(state, heartbeats("a", "b", "c"), now=0.0)
    assert only(actions, Wait).reason == "no arrivals yet"
    state, actions = step(state, [ArrivalSeen(arrival("a")), ArrivalSeen(arrival("b"))], now=1.0)
    assert only(actions, Wait).reason == "2 of K=3 arrived; waiting"
    state, actions = step(state, [ArrivalSeen(arrival("c"))], now=2.0)
    merge = only(actions, Merge)
    assert [a.learner for a in merge.arrivals] == ["a", "b", "c"]
    assert "every live learner arrived" in merge.reason
    assert state.quorum_seconds == pytest.approx(1.0)  # round opened at 1.0, quorum at 2.0


def test_grace_window_holds_the_merge_then_ends_early_when_the_last_live_learner_arrives():
    state = initial_state(now=0.0, policy=policy())
    state, _ = step(state, heartbeats("a", "b", "c", step_seconds=1.0), now=0.0)
    state, actions = step(state, [ArrivalSeen(arrival("a")), ArrivalSeen(arrival("b"))], now=1.0)
    # xi_step 1 s * tau 4 = 4 s budget; xi_quorum 0 (first sample), xi_sync unknown: grace = 0.5*4 = 2 s
    wait = only(actions, Wait)
    assert wait.reason == "grace window: 2.0 s left for 1 more learner (2 arrived)"
    assert wait.until == pytest.approx(3.0)
    state, actions = step(state, [], now=1.2)
    assert "1.8 s left for 1 more learner" in only(actions, Wait).reason
    state, actions = step(state, [ArrivalSeen(arrival("c"))], now=2.5)
    assert "every live learner arrived" in only(actions, Merge).reason


def test_grace_window_ends_and_merges_the_arrivals_it_has():
    state = initial_state(now=0.0, policy=policy())
    state, _ = step(state, heartbeats("a", "b", "c", step_seconds=1.0), now=0.0)
    state, _ = step(state, [ArrivalSeen(arrival("a")), ArrivalSeen(arrival("b"))], now=1.0)
    state, actions = step(state, [], now=3.01)
    merge = only(actions, Merge)
    assert len(merge.arrivals) == 2 and "the grace window ended" in merge.reason


def test_grace_is_capped():
    state = initial_state(now=0.0, policy=policy(max_grace_seconds=5.0))
    state, _ = step(state, heartbeats("a", "b", "c", step_seconds=100.0), now=0.0)
    assert state.grace_seconds(0.0) == 5.0
    state, actions = step(state, [ArrivalSeen(arrival("a")), ArrivalSeen(arrival("b"))], now=1.0)
    assert only(actions, Wait).until == pytest.approx(6.0)


def test_emas_follow_heartbeats_quorum_times_and_merge_durations():
    state = initial_state(now=0.0, policy=policy(ema_weight=0.5))
    state, _ = step(state, [HeartbeatSeen(LearnerId("a"), 2.0)], now=0.0)
    state, _ = step(state, [HeartbeatSeen(LearnerId("a"), 4.0)], now=0.5)
    assert state.learners["a"].step_seconds == pytest.approx(3.0)
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), seconds=2.0)], now=1.0)
    state, _ = step(state, [MergeFinished(P0, Version(2), Version(0), seconds=4.0)], now=1.0)
    assert state.sync_seconds == pytest.approx(3.0)
    # grace = 0.5 * max(0, 4 * 3.0 - xi_quorum 0 - xi_sync 3.0) = 4.5
    assert state.grace_seconds(1.0) == pytest.approx(4.5)


def test_a_dead_learner_does_not_count_as_live():
    state = initial_state(now=0.0, policy=policy(liveness_timeout_seconds=10.0, quorum=2, num_learners=3))
    state, _ = step(state, heartbeats("a", "b", "c", step_seconds=1.0), now=0.0)
    state, _ = step(state, heartbeats("a", "b", step_seconds=1.0), now=8.0)
    # c was last seen at 0; at 12 it is dead, so a and b are every live learner
    state, actions = step(state, [ArrivalSeen(arrival("a")), ArrivalSeen(arrival("b"))], now=12.0)
    assert state.live_learners(12.0) == {"a", "b"}
    assert "every live learner arrived" in only(actions, Merge).reason


def test_quorum_is_lowered_when_fewer_learners_live_but_not_while_learners_start():
    state = initial_state(now=0.0, policy=policy(quorum=3, num_learners=3, liveness_timeout_seconds=5.0))
    # a is the first learner seen; b and c are presumed live while the syncer starts up
    state, actions = step(state, [ArrivalSeen(arrival("a"))], now=0.0)
    assert only(actions, Wait).reason == "1 of K=3 arrived; waiting"
    state, _ = step(state, heartbeats("a", "b", "c"), now=1.0)
    state, actions = step(state, [ArrivalSeen(arrival("b"))], now=1.5)
    assert only(actions, Wait).reason == "2 of K=3 arrived; waiting"
    state, _ = step(state, heartbeats("b"), now=4.0)
    state, _ = step(state, heartbeats("c"), now=6.0)
    state, actions = step(state, [], now=6.5)  # a is dead now: b and c are live, K lowered to 2
    assert state.effective_quorum(6.5) == 2
    # quorum took 6.5 s, far beyond tau * xi_step = 4 s: no grace for c
    assert state.grace_seconds(6.5) == 0.0
    merge = only(actions, Merge)
    assert [a.learner for a in merge.arrivals] == ["a", "b"] and "the grace window ended" in merge.reason
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), 0.1)], now=6.6)
    state, actions = step(state, [], now=6.7)
    assert only(actions, Wait).reason == "no arrivals since its merge at version 1"  # not "yet" (issue 32, 8)


def test_the_lowered_quorum_is_explained():
    state = initial_state(now=0.0, policy=policy(quorum=3, num_learners=4, liveness_timeout_seconds=5.0))
    state, _ = step(state, heartbeats("a", "b"), now=6.0)
    state, actions = step(state, [ArrivalSeen(arrival("a"))], now=6.1)
    assert only(actions, Wait).reason == "1 of K=2 (lowered from 3: 2 live) arrived; waiting"


def test_the_newest_arrival_wins_and_older_ones_are_superseded():
    state = initial_state(now=0.0, policy=policy(quorum=2, num_learners=2))
    state, _ = step(state, [ArrivalSeen(arrival("a", sequence=1)), ArrivalSeen(arrival("a", sequence=3))], now=0.0)
    state, _ = step(state, [ArrivalSeen(arrival("a", sequence=2))], now=0.5)  # late, older
    state, _ = step(state, [ArrivalSeen(arrival("a", sequence=3))], now=0.6)  # seen again: ignored
    state, actions = step(state, [ArrivalSeen(arrival("b"))], now=1.0)
    merge = only(actions, Merge)
    assert [(a.learner, a.sequence) for a in merge.arrivals] == [("a", 3), ("b", 1)]
    assert sorted(a.sequence for a in merge.superseded) == [1, 2]
    # an arrival older than what was merged is discarded with a reason
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), 0.1)], now=1.1)
    state, actions = step(state, [ArrivalSeen(arrival("a", sequence=2))], now=1.2)
    assert "older than #3, already merged" in only(actions, Discard).reason


def test_arrivals_from_different_bases_hold_different_work_and_are_all_merged():
    # a sent from base 0, installed version 1 (which did not hold that send), sent again
    # from base 1: the second send does not contain the first, so both are merged
    state = initial_state(now=0.0, policy=policy(quorum=2, num_learners=2), versions={P0: (Version(1), Version(0))})
    state, _ = step(
        state, [ArrivalSeen(arrival("a", sequence=1, base=0)), ArrivalSeen(arrival("a", sequence=2, base=1))], now=0.0
    )
    state, _ = step(state, [ArrivalSeen(arrival("a", sequence=3, base=1))], now=0.1)  # supersedes #2 only
    state, actions = step(state, [ArrivalSeen(arrival("b", base=1))], now=0.2)
    merge = only(actions, Merge)
    assert [(a.learner, a.sequence) for a in merge.arrivals] == [("a", 1), ("a", 3), ("b", 1)]
    assert [a.sequence for a in merge.superseded] == [2]
    assert merge.reason.startswith("merging 2 learners")
    state, _ = step(state, [MergeFinished(P0, Version(2), Version(0), 0.1)], now=0.3)
    assert state.merged_sequence[("a", P0)] == 3


def test_one_learner_with_two_bases_counts_once_toward_the_quorum():
    state = initial_state(now=0.0, policy=policy(quorum=2, num_learners=2), versions={P0: (Version(1), Version(0))})
    state, actions = step(
        state, [ArrivalSeen(arrival("a", sequence=1, base=0)), ArrivalSeen(arrival("a", sequence=2, base=1))], now=0.0
    )
    assert only(actions, Wait).reason == "1 of K=2 arrived; waiting"


def test_the_run_ends_when_every_learner_finished_or_was_gone_long_enough():
    state = initial_state(now=0.0, policy=policy(num_learners=3, liveness_timeout_seconds=10.0, give_up_seconds=100.0))
    learners = [LearnerId(m) for m in "abc"]
    state, _ = step(
        state,
        [
            HeartbeatSeen(LearnerId("a"), 1.0, state="finished"),
            HeartbeatSeen(LearnerId("b"), 1.0, state="failed"),
            HeartbeatSeen(LearnerId("c"), 1.0),
        ],
        now=0.0,
    )
    assert not run_end(state, learners, now=1.0).over
    state, _ = step(state, [HeartbeatSeen(LearnerId("c"), 1.0, state="finished")], now=50.0)
    end = run_end(state, learners, now=60.0)
    assert not end.over and not end.given_up  # b failed 60 s ago: its supervisor may restart it
    end = run_end(state, learners, now=100.0)
    assert end.over and end.given_up == {"b": "failed for 100 s"}
    # a failed learner that came back is waited for again
    state, _ = step(state, [HeartbeatSeen(LearnerId("b"), 1.0, state="training")], now=101.0)
    assert not run_end(state, learners, now=150.0).over


def test_a_learner_never_heard_from_holds_up_nobody_once_the_others_are_done():
    """A Slurm job still queued when the others finished: the run ends once it has been
    silent past the liveness timeout, not after the give-up time as well."""
    state = initial_state(now=0.0, policy=policy(num_learners=3, liveness_timeout_seconds=10.0, give_up_seconds=100.0))
    learners = [LearnerId(m) for m in "abc"]
    state, _ = step(state, [HeartbeatSeen(LearnerId("a"), 1.0, state="finished")], now=1.0)
    state, _ = step(state, [HeartbeatSeen(LearnerId("b"), 1.0)], now=1.0)
    assert not run_end(state, learners, now=9.0).over  # c may still be starting
    assert not run_end(state, learners, now=50.0).over  # b trains: c may still start
    state, _ = step(state, [HeartbeatSeen(LearnerId("b"), 50.0, state="finished")], now=50.0)
    end = run_end(state, learners, now=50.0)
    assert end.over and end.given_up == {"c": "never started (50 s since the run began)"}


def test_a_run_nobody_was_heard_from_is_given_up_after_silence_plus_the_give_up_time():
    state = initial_state(now=0.0, policy=policy(num_learners=2, liveness_timeout_seconds=10.0, give_up_seconds=100.0))
    learners = [LearnerId("a"), LearnerId("b")]
    assert not run_end(state, learners, now=109.0).over
    end = run_end(state, learners, now=110.0)
    assert end.over and end.given_up == {"a": "silent for 100 s", "b": "silent for 100 s"}


def test_a_learner_never_heard_from_waits_for_a_learner_that_failed_to_come_back():
    """The give-up time still holds for a learner that trained and failed: while it may
    be restarted, the one never heard from is not given up either."""
    state = initial_state(now=0.0, policy=policy(num_learners=2, liveness_timeout_seconds=10.0, give_up_seconds=100.0))
    state, _ = step(state, [HeartbeatSeen(LearnerId("a"), 1.0, state="failed")], now=1.0)
    assert not run_end(state, [LearnerId("a"), LearnerId("b")], now=50.0).over
    end = run_end(state, [LearnerId("a"), LearnerId("b")], now=101.0)
    assert end.over and end.given_up == {"a": "failed for 100 s", "b": "never started (101 s since the run began)"}


def test_a_late_arrival_does_not_undo_a_finished_heartbeat():
    state = initial_state(now=0.0, policy=policy(quorum=1, num_learners=1))
    state, _ = step(state, [HeartbeatSeen(LearnerId("a"), 1.0, state="finished")], now=0.0)
    state, _ = step(state, [ArrivalSeen(arrival("a"))], now=1.0)
    assert state.learners["a"].state == "finished" and run_end(state, [LearnerId("a")], now=1.0).over


def test_a_learner_beyond_the_window_is_told_to_resync():
    state = initial_state(now=0.0, policy=policy(), versions={P0: (Version(9), Version(5))})
    state, actions = step(state, [ArrivalSeen(arrival("a", base=4))], now=0.0)
    resync = only(actions, Resync)
    assert resync.learner == "a" and resync.fragment == 0
    assert "older than the window (anchorable 5..9)" in resync.reason
    state, actions = step(state, [ArrivalSeen(arrival("b", base=12))], now=0.1)
    assert "newer than the syncer's" in only(actions, Resync).reason
    assert not state.round(P0).pending


def test_a_merging_fragment_waits_and_collects_the_next_round():
    state = initial_state(now=0.0, policy=policy(quorum=1, num_learners=2, num_fragments=2))
    state, actions = step(state, [ArrivalSeen(arrival("a"))], now=0.0)
    assert only(actions, Merge).fragment == 0
    state, actions = step(state, [ArrivalSeen(arrival("a", sequence=2))], now=0.5)
    assert "a merge is in progress" in [a for a in actions if isinstance(a, Wait) and a.fragment == 0][0].reason
    state, actions = step(state, [MergeFinished(P0, Version(1), Version(0), 0.4)], now=1.0)
    assert only(actions, Merge).arrivals[0].sequence == 2


def test_an_aborted_merge_puts_its_arrivals_back_and_merges_them_later():
    state = initial_state(now=0.0, policy=policy(quorum=2, num_learners=2))
    state, actions = step(
        state,
        [ArrivalSeen(arrival("a", sequence=1)), ArrivalSeen(arrival("a", sequence=2)), ArrivalSeen(arrival("b"))],
        now=0.0,
    )
    assert [a.sequence for a in only(actions, Merge).superseded] == [1]
    state, _ = step(state, [ArrivalSeen(arrival("b", sequence=2))], now=0.5)  # arrives while merging
    state, actions = step(state, [MergeAborted(P0)], now=1.0)
    merge = only(actions, Merge)  # b's newer send supersedes the aborted one; a's comes back
    assert [(a.learner, a.sequence) for a in merge.arrivals] == [("a", 2), ("b", 2)]
    assert sorted((a.learner, a.sequence) for a in merge.superseded) == [("a", 1), ("b", 1)]
    assert state.merged_sequence == {}  # nothing is merged until a merge finishes
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), 0.1)], now=1.5)
    assert state.merged_sequence == {("a", P0): 2, ("b", P0): 2}


def test_stopped_learners_are_not_waited_for():
    state = initial_state(now=0.0, policy=policy(quorum=1, num_learners=2))
    state, _ = step(state, heartbeats("a", "b", step_seconds=5.0), now=0.0)
    state, _ = step(state, [HeartbeatSeen(LearnerId("b"), None, state="finished")], now=0.5)
    state, actions = step(state, [ArrivalSeen(arrival("a"))], now=1.0)
    assert "every live learner arrived" in only(actions, Merge).reason


def test_policy_validation():
    with pytest.raises(ValueError, match="quorum K must be between 1 and M=2"):
        DecisionPolicy(num_learners=2, quorum=3, num_fragments=1)


# ------------------------------------------------------------- arrivals in aggregates


def in_aggregate(learner, group, anchor=0, sequence=1, base=0):
    return ArrivalSeen(replace(arrival(learner, sequence, base), group=group, anchor=Version(anchor)))


def test_an_aggregates_learners_count_for_the_quorum_and_it_is_merged_whole():
    state = initial_state(now=0.0, policy=policy(quorum=3, num_learners=3))
    state, _ = step(state, heartbeats("a", "b", "c"), now=0.0)
    state, actions = step(state, [in_aggregate("a", "east:A"), in_aggregate("b", "east:A")], now=1.0)
    assert only(actions, Wait).reason == "2 of K=3 arrived; waiting"
    state, actions = step(state, [in_aggregate("c", "west:B")], now=2.0)
    merge = only(actions, Merge)
    assert sorted((a.learner, a.group) for a in merge.arrivals) == [("a", "east:A"), ("b", "east:A"), ("c", "west:B")]


def test_an_aggregate_anchored_before_the_fragments_version_is_discarded_whole():
    state = initial_state(now=0.0, policy=policy(quorum=1, num_learners=2, grace_gamma=0.0))
    state, actions = step(state, [ArrivalSeen(arrival("a"))], now=0.0)
    merge = only(actions, Merge)
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), 0.1)], now=0.5)
    stale = [in_aggregate("b", "east:A", anchor=0), in_aggregate("c", "east:A", anchor=0)]
    state, actions = step(state, stale, now=1.0)
    discards = [a for a in actions if isinstance(a, Discard)]
    assert [d.arrival.group for d in discards] == ["east:A", "east:A"] and "anchored at version 0" in discards[0].reason
    assert not state.round(P0).pending and merge


def test_an_aggregate_holding_a_send_already_merged_is_discarded_with_its_pending_arrivals():
    state = initial_state(now=0.0, policy=policy(quorum=3, num_learners=3))
    state, _ = step(state, [ArrivalSeen(arrival("a", sequence=5))], now=0.0)
    state, _ = step(state, [ArrivalSeen(arrival("b")), ArrivalSeen(arrival("c"))], now=0.1)
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), 0.1)], now=0.2)
    # an aggregate at version 1 whose first arrival is fine and whose second was merged
    state, actions = step(
        state,
        [in_aggregate("b", "east:A", anchor=1, sequence=2), in_aggregate("a", "east:A", anchor=1, sequence=4)],
        now=1.0,
    )
    assert {a.arrival.learner for a in actions if isinstance(a, Discard)} == {"a"}
    assert not state.round(P0).pending, "the aggregate's arrival already pending was dropped with it"
    state, actions = step(state, [in_aggregate("c", "east:A", anchor=1, sequence=2)], now=1.1)
    assert "was discarded" in only(actions, Discard).reason


def test_a_merge_counts_only_the_arrivals_it_merged():
    state = initial_state(now=0.0, policy=policy(quorum=1, num_learners=1, grace_gamma=0.0))
    state, actions = step(state, [ArrivalSeen(arrival("a", sequence=3))], now=0.0)
    only(actions, Merge)
    state, _ = step(state, [MergeFinished(P0, Version(1), Version(0), 0.1, merged_keys=frozenset())], now=0.1)
    assert state.merged_sequence.get((LearnerId("a"), P0), -1) == -1  # refused when read: not merged


def test_a_send_its_reducer_could_not_anchor_asks_for_a_resync():
    state = initial_state(now=0.0, policy=policy())
    state, actions = step(state, [ResyncRequested(arrival("a", base=0))], now=0.0)
    resync = only(actions, Resync)
    assert resync.learner == "a" and "reinstall the newest global" in resync.reason
