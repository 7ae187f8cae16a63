"""A region's reducer's decisions (pure, fake clock, no storage): forwarding, relaying, resolving."""

from dataclasses import dataclass, field

import pytest

from diloco_cli.core import reducer_step as rs
from diloco_cli.core.forwarding import ForwardPolicy, Waiting
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.aggregates import AggregateRecord, SendRecord
from diloco_cli.store.region import PayloadRecord

P0 = FragmentIndex(0)


@dataclass(frozen=True)
class FakeHead:
    merged: dict = field(default_factory=dict)
    """(learner, fragment) -> the newest sequence merged."""
    finished: bool = False

    def merged_sequence(self, learner, fragment):
        return self.merged.get((learner, fragment), -1)


def payload(learner, sequence=1, base=0, fragment=P0):
    key = f"payloads/{learner}/{fragment:03d}-{sequence:012d}.dlc"
    return PayloadRecord(key, LearnerId(learner), fragment, sequence, Version(base), 10, 100, {})


def send(learner, sequence=1, base=0):
    return SendRecord(payload(learner, sequence, base).key, LearnerId(learner), sequence, Version(base), 10, 100)


def aggregate(serial, anchor=0, sends=(), resync=()):
    key = f"aggregates/{P0:03d}-{serial:012d}.dlc"
    return AggregateRecord(key, P0, serial, Version(anchor), tuple(sends), tuple(resync), {})


def waiting_state(*records, seen_at=0.0, **fields):
    return rs.ReducerState(
        waiting={r.key: Waiting(r.fragment, r, seen_at) for r in records},
        records={r.key: r for r in records},
        **fields,
    )


def policy(quorum, learners=4, region=2, window=1.0, longest=60.0):
    return ForwardPolicy(quorum, learners, region, window, longest)


def due(quorum, live=("a", "b"), version=0):
    return rs.ForwardingDue(policy(quorum), frozenset(LearnerId(m) for m in live), {P0: Version(version)})


def chosen(actions):
    """Per action, its kind and the learners (and sequences) it takes."""
    out = []
    for action in actions:
        if isinstance(action, rs.Forward):
            out.append(("forward", sorted((r.learner, r.sequence) for r in action.records)))
        elif isinstance(action, rs.Relay):
            out.append(("relay", [(action.record.learner, action.record.sequence)]))
    return out


@pytest.mark.parametrize(
    ("case", "records", "observation", "now", "expected"),
    [
        ("K = M: b is live and has not sent: wait", [payload("a")], due(4), 0.5, []),
        (
            "K = M: every live learner sent: at once",
            [payload("a"), payload("b")],
            due(4),
            0.0,
            [("forward", [("a", 1), ("b", 1)])],
        ),
        (
            "K = M: a learner that died is not waited for",
            [payload("a")],
            due(4, live=("a",)),
            0.0,
            [("forward", [("a", 1)])],
        ),
        (
            "K = M: the region's share arrived, another is live: the window runs",
            [payload("a"), payload("b")],
            due(4, live=("a", "b", "c")),
            0.5,
            [],
        ),
        (
            "K = M: the region's share arrived, the window is over",
            [payload("a"), payload("b")],
            due(4, live=("a", "b", "c")),
            1.0,
            [("forward", [("a", 1), ("b", 1)])],
        ),
        ("K = M: the longest wait is over", [payload("a")], due(4), 60.0, [("forward", [("a", 1)])]),
        (
            "K = M: a send from a base the copy has not reached waits",
            [payload("a", base=3)],
            due(4, live=("a",), version=2),
            0.0,
            [],
        ),
        (
            "K = M: the newest send of a base supersedes the older",
            [payload("a", 1), payload("a", 2), payload("b")],
            due(4),
            0.0,
            [("forward", [("a", 2), ("b", 1)])],
        ),
        ("K < M: relayed at once, whoever else is live", [payload("a")], due(1), 0.0, [("relay", [("a", 1)])]),
        (
            "K < M: a superseded send is not relayed",
            [payload("a", 1), payload("a", 2)],
            due(1),
            0.0,
            [("relay", [("a", 2)])],
        ),
        (
            "K < M: sends from different bases are all relayed",
            [payload("a", 1, base=0), payload("a", 2, base=1)],
            due(1, version=1),
            0.0,
            [("relay", [("a", 1)]), ("relay", [("a", 2)])],
        ),
    ],
)
def test_what_waits_is_forwarded_or_relayed_when_the_rules_say(case, records, observation, now, expected):
    state, actions = rs.step(waiting_state(*records), [observation], now)
    assert chosen(actions) == expected, case
    assert state == waiting_state(*records), "deciding changes nothing; the outcomes do"


def test_a_send_in_flight_holds_back_its_learners_next_send_of_the_fragment():
    in_flight = aggregate(1, sends=[send("a", 1)])
    state = waiting_state(payload("a", 2), payload("b"), in_flight={in_flight.key: in_flight})
    _, actions = rs.step(state, [due(4)], 0.0)
    assert chosen(actions) == [("forward", [("b", 1)])]


@pytest.mark.parametrize(
    ("case", "record", "head", "version", "expected"),
    [
        ("not moved on, nothing merged: waits", aggregate(1, sends=[send("a")]), FakeHead(), 0, None),
        (
            "moved on with every send: merged",
            aggregate(1, sends=[send("a"), send("b")]),
            FakeHead({("a", P0): 1, ("b", P0): 1}),
            1,
            (True, ["a", "b"]),
        ),
        (
            "moved on without it: discarded, nothing consumed",
            aggregate(1, sends=[send("a")]),
            FakeHead(),
            1,
            (False, []),
        ),
        (
            "one send merged before (another path): discarded, that one consumed",
            aggregate(1, sends=[send("a"), send("b")]),
            FakeHead({("a", P0): 1}),
            0,
            (False, ["a"]),
        ),
        (
            "merged, the resync it asked for is consumed too",
            aggregate(1, sends=[send("a")], resync=[send("c")]),
            FakeHead({("a", P0): 1}),
            1,
            (True, ["a", "c"]),
        ),
        (
            "only a resync, the run finished: cleared",
            aggregate(1, resync=[send("c")]),
            FakeHead(finished=True),
            0,
            (True, ["c"]),
        ),
        (
            "only a resync, the run goes on: waits for the fragment",
            aggregate(1, resync=[send("c")]),
            FakeHead(),
            0,
            None,
        ),
    ],
)
def test_an_aggregate_in_flight_is_resolved_from_the_heads_marks(case, record, head, version, expected):
    state = rs.ReducerState(in_flight={record.key: record})
    _, actions = rs.step(state, [rs.HeadSeen(head, {P0: Version(version)})], 0.0)
    if expected is None:
        assert actions == [], case
        return
    (action,) = actions
    merged, learners = expected
    assert action.merged == merged, case
    assert sorted(key.split("/")[1] for key in action.consumed) == learners, case
    cleared, _ = rs.step(state, [rs.AggregateCleared(record.key, action.merged, action.consumed)], 0.0)
    assert not cleared.in_flight and cleared.consumed == set(action.consumed)
    assert cleared.counts["voided"] == (0 if merged else 1)


def test_a_discarded_aggregates_sends_wait_again_and_go_out_anew():
    record = aggregate(1, sends=[send("a"), send("b")])
    state = rs.ReducerState(in_flight={record.key: record})
    state, _ = rs.step(state, [rs.AggregateCleared(record.key, merged=False, consumed=())], 0.0)
    listed = rs.PayloadsListed(
        FakeHead(), (payload("a").key, payload("b").key), {p.key: p for p in (payload("a"), payload("b"))}
    )
    assert state.to_read(listed.present) == list(listed.present)
    state, actions = rs.step(state, [listed, due(4, version=1)], 5.0)
    assert chosen(actions) == [("forward", [("a", 1), ("b", 1)])]
    assert {item.seen_at for item in state.waiting.values()} == {5.0}


def test_an_aggregate_that_vanished_is_void():
    gone, kept = aggregate(1, sends=[send("a")]), aggregate(2, sends=[send("b")])
    state = rs.ReducerState(in_flight={gone.key: gone, kept.key: kept})
    state, actions = rs.step(state, [rs.AggregatesListed(frozenset({kept.key}))], 0.0)
    assert actions == [rs.VoidAggregate(gone)]
    assert list(state.in_flight) == [kept.key] and state.counts["voided"] == 1


def test_looking_consumes_what_was_merged_waits_what_is_new_and_removes_what_was_refused():
    merged, new, refused = payload("a", 1), payload("b", 2), payload("c", 3)
    head = FakeHead({("a", P0): 1})
    listed = rs.PayloadsListed(
        head, (merged.key, new.key, refused.key), {merged.key: merged, new.key: new}, refused=(refused.key,)
    )
    state, actions = rs.step(rs.ReducerState(), [listed], 7.0)
    assert actions == [rs.Consume(merged.key), rs.RemoveRefused((refused.key,))]
    assert list(state.waiting) == [new.key] and state.waiting[new.key].seen_at == 7.0
    assert state.consumed == {merged.key} and state.refused_payloads == {refused.key}
    passed = rs.PayloadsListed(head, (new.key,), {}, merged_past=frozenset({refused.key}))
    state, _ = rs.step(state, [passed], 8.0)
    assert not state.refused_payloads and state.waiting[new.key].seen_at == 7.0  # waits since it was first seen


def test_a_payload_gone_from_the_listing_waits_no_more_and_a_cut_listing_waits_for_later():
    a, b = payload("a"), payload("b")
    state = waiting_state(a)
    state, _ = rs.step(state, [rs.PayloadsListed(FakeHead(), (b.key,), {b.key: b}, cut_at=b.key)], 0.0)
    assert not state.waiting  # a is gone; b's marker could not be read now


def test_a_relay_the_syncer_let_go_of_releases_its_payload():
    record = payload("a")
    relay_key = "relays/a/000-000000000001.dlc"
    state, _ = rs.step(waiting_state(record), [rs.Relayed(relay_key, record)], 0.0)
    assert not state.waiting and state.relayed == {relay_key: record} and state.counts["sends"] == 1
    assert state.held_keys == {record.key} and state.holding
    state, actions = rs.step(state, [rs.RelaysListed(frozenset({relay_key}))], 0.0)
    assert actions == []
    state, actions = rs.step(state, [rs.RelaysListed(frozenset())], 0.0)
    assert actions == [rs.ReleaseRelay(relay_key, record)]
    state, _ = rs.step(state, [rs.RelayReleased(relay_key)], 0.0)
    assert not state.relayed and state.consumed == {record.key} and not state.holding


def test_an_aggregate_written_takes_its_sends_and_a_refused_send_waits_no_more():
    a, b, c = payload("a"), payload("b"), payload("c")
    written = aggregate(1, sends=[send("a")], resync=[send("b")])
    state, actions = rs.step(waiting_state(a, b, c), [rs.PayloadsRefused((c.key,)), rs.AggregateWritten(written)], 0.0)
    assert actions == [rs.RemoveRefused((c.key,))]
    assert not state.waiting and list(state.in_flight) == [written.key]
    assert state.counts == {"aggregates": 1, "sends": 1, "voided": 0} and state.refused_payloads == {c.key}
