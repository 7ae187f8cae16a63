"""A whole merge round: anchoring, weighting, RDA, Nesterov and exact publication."""

import pytest
import torch

from diloco_cli.codec import Codec, CodecSpec, CorruptPayload, encode_payload
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.core.anchor import BaseOutsideWindow, UpdateWindow
from diloco_cli.core.merge import radial_directional_average, token_weight, weighted_mean
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime.syncer.merge_round import RoundInput, merge_round

FP32 = CodecSpec(codec=Codec.FP32, zstd_level=0)


def arrival_payload(secret, learner, base, delta, spec=FP32):
    meta = {"learner": learner, "fragment": 0, "base_version": base}
    return encode_payload(delta.items(), spec, secret, meta)


def test_round_anchors_stale_learners_and_matches_the_formulas(secret):
    theta0 = {"emb": torch.tensor([1.0, 2.0]), "w": torch.tensor([0.5, -0.5, 1.0])}
    parameters = {k: v.clone() for k, v in theta0.items()}
    window = UpdateWindow(size=4)
    optimizer = NesterovOuterOptimizer(learning_rate=1.0, momentum=0.0)
    publisher = ExactPublisher(FP32, secret)
    # version 1: learner a alone, from base 0
    delta_a = {"emb": torch.tensor([0.1, 0.0]), "w": torch.tensor([0.0, 0.2, 0.0])}
    first = merge_round(
        FragmentIndex(0),
        Version(1),
        [RoundInput(LearnerId("a"), Version(0), 10, 100, lambda: arrival_payload(secret, "a", 0, delta_a))],
        parameters,
        window,
        optimizer,
        publisher,
        secret,
        mean_names={"emb"},
    )
    assert [a.learner for a in first.merged] == ["a"]
    for name in theta0:  # lr 1, no momentum: Theta1 = Theta0 - Delta_a
        torch.testing.assert_close(parameters[name], theta0[name] - delta_a[name])
    theta1 = {k: v.clone() for k, v in parameters.items()}
    # version 2: b is stale (base 0), c is current (base 1)
    delta_b = {"emb": torch.tensor([0.0, 0.3]), "w": torch.tensor([0.4, 0.0, 0.0])}
    delta_c = {"emb": torch.tensor([0.2, 0.2]), "w": torch.tensor([0.0, 0.0, -0.1])}
    weights = {"b": token_weight(300, 10), "c": token_weight(100, 10)}
    merge_round(
        FragmentIndex(0),
        Version(2),
        [
            RoundInput(LearnerId("b"), Version(0), 10, 300, lambda: arrival_payload(secret, "b", 0, delta_b)),
            RoundInput(LearnerId("c"), Version(1), 10, 100, lambda: arrival_payload(secret, "c", 1, delta_c)),
        ],
        parameters,
        window,
        optimizer,
        publisher,
        secret,
        mean_names={"emb"},
    )
    drift_b = {k: theta1[k] - theta0[k] for k in theta0}  # Theta_now - Theta^0
    outer_b = {k: drift_b[k] + delta_b[k] for k in theta0}
    w = [weights["b"], weights["c"]]
    expected = {
        "emb": theta1["emb"] - weighted_mean([outer_b["emb"], delta_c["emb"]], w),
        "w": theta1["w"] - radial_directional_average([outer_b["w"], delta_c["w"]], w),
    }
    for name in theta0:
        torch.testing.assert_close(parameters[name], expected[name], rtol=0, atol=1e-6)
    assert window.versions == [1, 2]


def test_round_skips_a_corrupted_payload_and_reports_it(secret):
    parameters = {"w": torch.zeros(4)}
    good = arrival_payload(secret, "a", 0, {"w": torch.ones(4)})
    bad = bytearray(arrival_payload(secret, "b", 0, {"w": torch.ones(4)}))
    bad[-1] ^= 0xFF
    mislabelled = arrival_payload(secret, "a", 0, {"w": torch.ones(4)})
    result = merge_round(
        FragmentIndex(0),
        Version(1),
        [
            RoundInput(LearnerId("a"), Version(0), 1, 1, lambda: good),
            RoundInput(LearnerId("b"), Version(0), 1, 1, lambda: bytes(bad)),
            RoundInput(LearnerId("c"), Version(0), 1, 1, lambda: mislabelled),
        ],
        parameters,
        UpdateWindow(2),
        NesterovOuterOptimizer(1.0, 0.0),
        ExactPublisher(FP32, secret),
        secret,
    )
    assert [a.learner for a in result.merged] == ["a"]
    assert [type(error) for _, error in result.rejected] == [CorruptPayload, CorruptPayload]
    assert "disagrees with its arrival record" in str(result.rejected[1][1])
    torch.testing.assert_close(parameters["w"], -torch.ones(4))


def test_a_learner_replaying_published_rounds_matches_the_syncer(secret):
    spec = CodecSpec(codec=Codec.INT4)
    parameters = {"w": torch.randn(300)}
    learner = {"w": parameters["w"].clone()}
    window, optimizer, publisher = UpdateWindow(3), NesterovOuterOptimizer(0.7, 0.9), ExactPublisher(spec, secret)
    payloads = []
    for version in range(1, 6):
        delta = {"w": torch.randn(300) * 0.01}
        result = merge_round(
            FragmentIndex(0),
            Version(version),
            [
                RoundInput(
                    LearnerId("a"),
                    Version(version - 1),
                    5,
                    50,
                    lambda d=delta, v=version: arrival_payload(secret, "a", v - 1, d, spec),
                )
            ],
            parameters,
            window,
            optimizer,
            publisher,
            secret,
        )
        payloads.append(result.payload)
    for payload in payloads:
        apply_update(learner, payload, secret)
    assert torch.equal(learner["w"], parameters["w"])
    with pytest.raises(BaseOutsideWindow):
        merge_round(
            FragmentIndex(0),
            Version(6),
            [RoundInput(LearnerId("a"), Version(1), 1, 1, lambda: b"")],
            parameters,
            window,
            optimizer,
            publisher,
            secret,
        )
