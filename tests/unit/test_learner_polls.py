"""A learner looks for new global weights often only while a send of its awaits the merge."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from diloco_cli.codec import CodecSpec
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.types import LearnerId, Version
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.runtime.learner.poller import GlobalPoller, Poll


def test_a_send_awaits_its_merge_from_the_send_to_the_install_of_a_newer_version(secret):
    fragments = LearnerFragments(
        tuple(Fragment(index=p, parameter_names=(f"w{p}",), num_bytes=4, mean_names=frozenset()) for p in (0, 1)),
        {"w0": torch.Size([1]), "w1": torch.Size([1])},
        keep_unsent=True,
    )
    for p in (0, 1):
        fragments.install(p, Version(0), {f"w{p}": torch.tensor([0.0])})
    assert not fragments.awaiting_merge  # nothing sent yet
    fragments.count_step(8)
    assert not fragments.awaiting_merge  # trained, not sent
    fragments.encode_delta(1, {"w1": torch.tensor([1.0])}, CodecSpec(codec="fp32", zstd_level=0), secret, {})
    assert fragments.awaiting_merge == (1,)
    fragments.install(0, Version(1), {"w0": torch.tensor([5.0])})
    assert fragments.awaiting_merge == (1,)  # the other fragment's merge came, not this one's
    fragments.install(1, Version(2), {"w1": torch.tensor([5.0])})
    assert not fragments.awaiting_merge


def test_an_install_counts_the_steps_trained_since_the_fragments_send(secret):
    """The lag a heartbeat reports: steps from a send to the install after it, in the
    learner's own steps (None where nothing was sent since the last install); the
    heartbeat carries the median of the latest installs'."""
    from diloco_cli.runtime.learner.progress import Progress

    fragments = LearnerFragments(
        (Fragment(index=0, parameter_names=("w",), num_bytes=4, mean_names=frozenset()),),
        {"w": torch.Size([1])},
        keep_unsent=True,
    )
    fragments.install(0, Version(0), {"w": torch.tensor([0.0])})
    assert fragments.install_lag[0] is None  # the first install follows no send
    progress = Progress()
    for sent_after, installed_after in [(3, 7), (5, 2), (4, 12)]:
        for _ in range(sent_after):
            fragments.count_step(8)
        fragments.encode_delta(0, {"w": torch.tensor([1.0])}, CodecSpec(codec="fp32", zstd_level=0), secret, {})
        for _ in range(installed_after):
            fragments.count_step(8)
        fragments.install(0, Version(fragments.base_version[0] + 1), {"w": torch.tensor([0.0])})
        assert fragments.install_lag[0] == installed_after
        progress.count_installs([fragments.install_lag[0]])
    fragments.install(0, Version(9), {"w": torch.tensor([0.0])})  # a newer merge, nothing sent since
    assert fragments.install_lag[0] is None
    progress.count_installs([None])
    assert progress.installs == 4 and progress.install_lag_steps == 7


def _looked(poller: GlobalPoller, awaiting: tuple = ()) -> bool:
    """Whether ``start_if_due`` started a look now (a look with no readers is over at once)."""
    poller.start_if_due({}, awaiting=awaiting)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        if isinstance(poller.take(), Poll):
            return True
        time.sleep(0.002)
    return False


def test_the_poller_looks_every_poll_seconds_and_every_awaiting_seconds_while_a_send_awaits(monkeypatch):
    import diloco_cli.runtime.learner.poller as poller_module

    now = [1000.0]
    monkeypatch.setattr(poller_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    poller = GlobalPoller([], LearnerId("east-0"), poll_seconds=30.0, awaiting_seconds=0.05)
    try:
        expected = [(0.0, (), True), (0.1, (), False), (0.1, (0,), True), (0.12, (0,), False)]
        expected += [(29.0, (), False), (30.2, (), True)]  # 30 s after the last look, at 1000.1
        for at, awaiting, looks in expected:
            now[0] = 1000.0 + at
            assert _looked(poller, awaiting) is looks, (at, awaiting)
    finally:
        poller.close()
    quick = GlobalPoller([], LearnerId("east-1"), poll_seconds=0.05, awaiting_seconds=30.0)
    try:
        assert _looked(quick, awaiting=(0,))
        now[0] += 0.06
        assert _looked(quick, awaiting=(0,))  # never slower while awaiting than otherwise
    finally:
        quick.close()


def test_a_late_merge_ends_the_often_looks_after_three_usual_round_trips(monkeypatch):
    """A syncer down or a quorum waiting for a slow learner: a send still unmerged after
    3 of the learner's usual round trips (at least 10 s) is late, and the learner goes
    back to its plain interval until the merge comes; a usual round trip of 20 s (a long
    WAN round) widens the window to 60 s."""
    import diloco_cli.runtime.learner.poller as poller_module

    now = [0.0]
    monkeypatch.setattr(poller_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    poller = GlobalPoller([], LearnerId("east-0"), poll_seconds=5.0, awaiting_seconds=0.2)
    try:
        assert _looked(poller, (0,))  # sent at 0
        looks = []
        for at in (0.3, 0.6, 9.5, 9.8, 10.1, 10.4, 15.1, 15.4):
            now[0] = at
            looks.append(_looked(poller, (0,)))
        # often until 10 s after the send, then every 5 s (9.8, then 15.1)
        assert looks == [True, True, True, True, False, False, True, False]
        for _ in range(3):  # three sends, each installed 20 s later
            now[0] += 100.0
            poller.start_if_due({}, awaiting=(1,))
            now[0] += 20.0
            poller.start_if_due({}, awaiting=())
            assert _looked(poller)  # the look that started
        assert poller.awaiting_window() == pytest.approx(60.0)
        now[0] += 100.0
        _looked(poller, (1,))
        now[0] += 59.0
        assert _looked(poller, (1,))  # 59 s after the send, still expected
    finally:
        poller.close()


def test_a_resync_reinstalls_the_fragments_behind_the_head_and_keeps_the_work_on_those_at_it(harness):
    """Told to resync (a send of its was too stale to anchor), a learner fetches every
    fragment behind the head whole and overwrites it; a fragment already at the head's
    version holds the newest global, and keeps what it trained since (a reinstall of the
    same version would drop that work, and the next send from it would supersede one in
    flight from that version: the slurm test once lost a send's tokens that way)."""
    from diloco_cli.core.types import LearnerId

    east0, east1 = harness.learners
    harness.train(east0, 10)  # H=10, P=2: both fragments sent
    harness.merge()
    harness.poll(east0)  # east-0 at the head for both fragments
    harness.train(east1, 5)  # fragment 1 (due at step 5) sent by east-1: its head moves past east-0's base
    harness.merge()
    harness.train(east0, 3)  # unsent work on both fragments
    head = harness.bucket.read_head()
    behind = {p for p, v in east0.fragments.base_version.items() if v < head.fragment_versions[p]}
    assert behind == {1}, (east0.fragments.base_version, head.fragment_versions)
    tokens_before = dict(east0.fragments.c_tokens)
    harness.syncer.notes.resync(LearnerId("east-0"), "east", 0, "a stale send, in a test")
    harness.syncer.notes.deliver()
    assert harness.poll(east0) == {1: False}  # fragment 1 overwritten; fragment 0 kept as it was
    assert east0.fragments.base_version == head.fragment_versions
    assert east0.fragments.c_tokens[1] == 0 and east0.fragments.tokens_overwritten[1] > 0
    assert east0.fragments.c_tokens[0] == tokens_before[0] > 0 and east0.fragments.tokens_overwritten[0] == 0
    assert east0.poller.resync_seen[0] == 1  # answered
    harness.assert_bases_equal_the_syncers(east0)
