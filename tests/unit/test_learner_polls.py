"""A learner looks for new global weights often only while a send of its awaits the merge."""

from __future__ import annotations

import time
from types import SimpleNamespace

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
    assert fragments.awaiting_merge
    fragments.install(0, Version(1), {"w0": torch.tensor([5.0])})
    assert fragments.awaiting_merge  # the other fragment's merge came, not this one's
    fragments.install(1, Version(2), {"w1": torch.tensor([5.0])})
    assert not fragments.awaiting_merge


def _looked(poller: GlobalPoller, awaiting: bool) -> bool:
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
        expected = [(0.0, False, True), (0.1, False, False), (0.1, True, True), (0.12, True, False)]
        expected += [(29.0, False, False), (30.2, False, True)]  # 30 s after the last look, at 1000.1
        for at, awaiting, looks in expected:
            now[0] = 1000.0 + at
            assert _looked(poller, awaiting) is looks, (at, awaiting)
    finally:
        poller.close()
    quick = GlobalPoller([], LearnerId("east-1"), poll_seconds=0.05, awaiting_seconds=30.0)
    try:
        assert _looked(quick, awaiting=True)
        now[0] += 0.06
        assert _looked(quick, awaiting=True)  # never slower while awaiting than otherwise
    finally:
        quick.close()
