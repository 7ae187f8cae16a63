"""Anchored outer gradients from the window of recent updates."""

import pytest
import torch

from diloco_cli.core.anchor import BaseOutsideWindow, UpdateWindow, anchored_outer_gradient
from diloco_cli.core.types import Version


def constant_update(value, loads):
    def add_to(drift):
        loads.append(value)
        drift["w"].add_(torch.full((2,), float(value)))

    return add_to


def test_drift_sums_the_updates_after_each_base_loading_each_once():
    loads = []
    window = UpdateWindow(size=3)
    for version in (1, 2, 4, 7):  # versions of this fragment's updates (global counter)
        window.record(Version(version), constant_update(version, loads))
    assert window.versions == [2, 4, 7] and window.oldest_anchorable == 1
    drifts = {
        base: drift["w"][0].item()
        for base, drift in window.drifts([Version(7), Version(3), Version(1), Version(5)], {"w": (2,)})
    }
    assert drifts == {7: 0.0, 5: 7.0, 3: 11.0, 1: 13.0}
    assert sorted(loads) == [2, 4, 7]


def test_a_base_older_than_the_window_cannot_be_anchored():
    window = UpdateWindow(size=2)
    for version in (1, 2, 3):
        window.record(Version(version), constant_update(version, []))
    assert window.can_anchor(Version(1)) and not window.can_anchor(Version(0))
    with pytest.raises(BaseOutsideWindow, match="base version 0 cannot be anchored"):
        list(window.drifts([Version(0)], {"w": (2,)}))
    with pytest.raises(BaseOutsideWindow):
        list(window.drifts([Version(4)], {"w": (2,)}))
    with pytest.raises(ValueError, match="versions only grow"):
        window.record(Version(3), constant_update(3, []))


def test_anchored_gradient_golden():
    """Theta^b = 1, learner reached theta = 0.75 (delta 0.25), global moved to 1.5 since."""
    delta = {"w": torch.tensor([0.25])}
    drift = {"w": torch.tensor([0.5])}  # Theta_now - Theta^b
    assert anchored_outer_gradient(delta, drift)["w"].item() == pytest.approx(1.5 - 0.75)
