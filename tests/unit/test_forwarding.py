"""When a region's reducer forwards an aggregate, and which sends it holds (pure, fake clock)."""

from diloco_cli.core.forwarding import ForwardPolicy, Waiting, newest_per_base, to_forward
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.aggregates import SendRecord

P0 = FragmentIndex(0)


def waiting(learner, sequence=1, base=0, seen_at=0.0):
    send = SendRecord(
        f"payloads/{learner}/000-{sequence:012d}.dlc", LearnerId(learner), sequence, Version(base), 10, 100
    )
    return Waiting(P0, send, seen_at)


def policy(quorum, learners=4, region=2, window=1.0, longest=60.0):
    return ForwardPolicy(quorum, learners, region, window, longest)


def learners_of(items):
    return sorted(item.send.learner for item in items)


def test_the_regions_share_of_the_quorum():
    assert policy(quorum=4).region_share == 2  # K = M: every learner of the region
    assert policy(quorum=1).region_share == 1
    assert policy(quorum=3, learners=8, region=4).region_share == 2
    assert policy(quorum=1, learners=4, region=0).region_share == 1


def test_under_k_equals_m_it_waits_for_every_live_learner_of_the_region_then_forwards_at_once():
    live = {"a", "b"}
    assert to_forward([waiting("a")], set(), live, policy(quorum=4), now=30.0) == []  # b is alive: wait
    chosen = to_forward([waiting("a"), waiting("b", seen_at=30.0)], set(), live, policy(quorum=4), now=30.0)
    assert learners_of(chosen) == ["a", "b"]


def test_a_learner_that_is_not_live_is_not_waited_for():
    assert learners_of(to_forward([waiting("a")], set(), {"a"}, policy(quorum=4), now=0.0)) == ["a"]


def test_under_k_equals_1_the_first_send_goes_once_the_window_passed():
    live = {"a", "b"}
    assert to_forward([waiting("a", seen_at=10.0)], set(), live, policy(quorum=1), now=10.5) == []
    assert learners_of(to_forward([waiting("a", seen_at=10.0)], set(), live, policy(quorum=1), now=11.0)) == ["a"]


def test_a_send_waits_no_longer_than_the_longest_wait_whatever_else():
    live = {"a", "b"}
    assert to_forward([waiting("a", seen_at=0.0)], set(), live, policy(quorum=4), now=59.0) == []
    assert learners_of(to_forward([waiting("a", seen_at=0.0)], set(), live, policy(quorum=4), now=60.0)) == ["a"]


def test_a_learner_in_an_aggregate_in_flight_waits_and_counts_as_arrived():
    live = {"a", "b"}
    # b is in flight: a alone completes the region (K = M), but b's newer send must wait
    chosen = to_forward([waiting("a"), waiting("b", sequence=2)], {"b"}, live, policy(quorum=4), now=0.0)
    assert learners_of(chosen) == ["a"]
    assert to_forward([waiting("b", sequence=2)], {"b"}, live, policy(quorum=4), now=0.0) == []


def test_of_a_learners_sends_from_one_base_only_the_newest_goes():
    items = [waiting("a", sequence=1), waiting("a", sequence=3), waiting("a", sequence=2, base=1)]
    assert [(i.send.sequence, i.send.base_version) for i in newest_per_base(items)] == [(2, 1), (3, 0)]
