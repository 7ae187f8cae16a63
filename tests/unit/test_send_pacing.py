"""When a learner sends: by the steps, or by the merges that answer its sends (``sync.pace``)."""

import time

import pytest

from diloco_cli.core.fragments import SendPacing, fragments_due

H, P = 10, 2


def sends(pacing: SendPacing, steps: range, installs: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """The steps at which each fragment goes, with an install of fragment p after each
    step listed in ``installs[p]``."""
    sent: dict[int, list[int]] = {p: [] for p in range(P)}
    for step in steps:
        for p in pacing.due(step, H):
            pacing.sent(p, step)
            sent[p].append(step)
        for p, at in (installs or {}).items():
            if step in at:
                pacing.installed([q == p for q in range(P)], step, H)
    return sent


def test_by_the_steps_the_sends_are_the_staggered_schedules():
    pacing = SendPacing(P, False, (), H)
    expected = {p: [s for s in range(1, 61) if p in fragments_due(s, H, P)] for p in range(P)}
    assert (
        sends(pacing, range(1, 61), {0: [12, 33], 1: [7]})
        == expected
        == {0: [10, 20, 30, 40, 50, 60], 1: [5, 15, 25, 35, 45, 55]}
    )


@pytest.mark.parametrize(("start", "first"), [(0, {0: 10, 1: 5}), (33, {0: 40, 1: 35}), (37, {0: 40, 1: 45})])
def test_by_the_merges_the_first_send_of_each_fragment_is_where_the_steps_put_it(start, first):
    pacing = SendPacing(P, True, (), H)
    pacing.start_at(start, H)
    sent = sends(pacing, range(start + 1, start + H + 1))
    assert {p: steps[0] for p, steps in sent.items()} == first


def test_by_the_merges_a_fragment_goes_H_steps_after_the_install_that_answered_its_send():
    pacing = SendPacing(P, True, (), H)
    # fragment 0 sent at 10, answered after 14: next at 24, answered after 31: next at 41
    sent = sends(pacing, range(1, 45), {0: [14, 31]})
    assert sent[0] == [10, 24, 41]


def test_by_the_merges_an_unanswered_send_is_followed_by_the_next_2H_steps_later():
    pacing = SendPacing(P, True, (), H)
    assert sends(pacing, range(1, 56))[0] == [10, 30, 50]


def test_an_install_with_no_send_in_flight_changes_nothing():
    """Another learner's merge (K < M), or the start's version 0, answers no send of this one."""
    pacing = SendPacing(P, True, (), H)
    sent = sends(pacing, range(1, 40), {0: [3, 8, 12, 13]})  # only 12 answers the send at 10
    assert sent[0] == [10, 22]


def merge_lags(by_merges: bool, ticks: int = 4000) -> list[int]:
    """Two learners under K = M on one fragment, one 10% faster than the other: a round
    is merged once both sent since the last merge, and both install it at the next tick.
    Returns the fast learner's install lags (its steps between its send and the install)."""
    speeds = (1.1, 1.0)
    progress = [0.0, 0.0]
    steps = [0, 0]
    pacings = [SendPacing(1, by_merges, (), H) for _ in speeds]
    last_send: list[int | None] = [None, None]
    in_round: set[int] = set()
    publish_at: int | None = None
    lags = []
    for tick in range(ticks):
        if publish_at == tick:
            for learner, pacing in enumerate(pacings):
                pacing.installed([True], steps[learner], H)
                if learner == 0 and last_send[0] is not None:
                    lags.append(steps[0] - last_send[0])
            publish_at = None
        for learner, speed in enumerate(speeds):
            progress[learner] += speed
            while steps[learner] < int(progress[learner]):
                steps[learner] += 1
                if pacings[learner].due(steps[learner], H):
                    pacings[learner].sent(0, steps[learner])
                    last_send[learner] = steps[learner]
                    in_round.add(learner)
        if len(in_round) == len(speeds) and publish_at is None:
            in_round.clear()
            publish_at = tick + 1
    return lags


def test_under_k_equals_m_pacing_by_the_merges_keeps_a_fast_learners_installs_fresh():
    """By the steps, the faster learner drifts ahead and installs each merge up to about H
    of its steps late; by the merges both send together again after every install."""
    by_steps, by_merges = merge_lags(False), merge_lags(True)
    assert max(by_steps[-20:]) >= H - 2  # drifted a round ahead: every merge about H late
    assert max(by_merges) <= 3
    assert len(by_merges) >= 0.8 * len(by_steps)  # rounds a merge's round trip longer, no fewer than that


def test_a_learner_ahead_paced_by_the_merges_sends_H_steps_after_each_install_that_answered_it(tmp_path, secret):
    """Through a real region reducer and syncer under K = M: east-0 runs ahead of east-1,
    so each of its sends is answered only once east-1's lands; its next send of each
    fragment comes H steps after that install, not at the step the schedule names."""
    from diloco_cli.store.home import tokens_merged
    from tests.support.harness import Harness

    harness = Harness(tmp_path, secret, quorum=2, pace="merges")
    try:
        east0, east1 = harness.learners

        def sent_by_east0() -> list[int]:
            return sorted(int(key.split("/")[2][:3]) for key in harness.bucket.payload_keys() if "/east-0/" in key)

        def turns_until_merged(fragment: int, version: int) -> None:
            """The reducer's and syncer's turns until ``fragment`` is at ``version`` (the
            other fragment's round still waits for east-1: :meth:`Harness.merge` would not end)."""
            deadline = time.monotonic() + 30
            while harness.syncer.state.fragment_versions[fragment] < version:
                assert time.monotonic() < deadline, harness.syncer.state.fragment_versions
                harness.reducer.turn(read_heartbeats=True)
                harness.syncer.turn()
                harness.reducer.turn()

        harness.train(east0, 10)  # fragment 1 sent at step 5, fragment 0 at step 10
        harness.train(east1, 5)  # east-1's fragment 1: its round merged
        turns_until_merged(1, 1)
        harness.train(east0, 1)
        assert harness.poll(east0) == {1: True}  # answered after step 11: fragment 1 next at 21
        harness.train(east1, 5)
        harness.merge()
        harness.train(east0, 2)
        assert harness.poll(east0) == {0: True}  # answered after step 13: fragment 0 next at 23
        assert harness.poll(east1) == {0: True, 1: True}
        assert sent_by_east0() == []  # both merged and taken in
        harness.train(east0, 7)  # to step 20, where the steps put fragment 1 at 15 and fragment 0 at 20
        assert sent_by_east0() == []
        harness.train(east0, 1)
        assert sent_by_east0() == [1]  # step 21
        harness.train(east0, 2)
        assert sent_by_east0() == [0, 1]  # step 23
        harness.train(east1, 10)  # east-1 installed both after its step 10: sends both at 20
        harness.merge()
        assert harness.poll(east0) == harness.poll(east1) == {0: True, 1: True}
        harness.assert_bases_equal_the_syncers(east0)
        harness.assert_bases_equal_the_syncers(east1)
        history = harness.syncer.home.history()
        sent_through = {east0: {0: 23, 1: 21}, east1: {0: 20, 1: 20}}  # the step of each fragment's last send
        for learner, steps in sent_through.items():  # every step trained up to it is in a merged send
            for fragment in (0, 1):
                assert tokens_merged(history, learner.me.id, fragment) == steps[fragment] * learner.tokens_per_step
    finally:
        harness.close()
