"""Exact publication: learners that apply the published updates hold the syncer's weights."""

import pytest
import torch

from diloco_cli.codec import Codec, CodecSpec, encode_payload
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.core.merge import MergeAccumulator, token_weight
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex


@pytest.mark.parametrize("codec", [Codec.INT4, Codec.INT8, Codec.BF16, Codec.TOPK])
def test_learners_applying_updates_in_order_are_bit_identical_to_the_syncer(secret, codec):
    generator = torch.Generator().manual_seed(1)
    shapes = {"w": (64, 33), "b": (33,)}
    initial = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    syncer = {name: tensor.clone() for name, tensor in initial.items()}
    learners = [{name: tensor.clone() for name, tensor in initial.items()} for _ in range(3)]
    optimizer = NesterovOuterOptimizer(learning_rate=0.7, momentum=0.9)
    publisher = ExactPublisher(CodecSpec(codec=codec), secret)
    published = []
    for version in range(1, 9):
        accumulator = MergeAccumulator(shapes)
        for _ in range(3):
            accumulator.add(
                {n: torch.randn(s, generator=generator) * 1e-2 for n, s in shapes.items()}, token_weight(500, 5)
            )
        new = optimizer.step(FragmentIndex(0), syncer, accumulator.result())
        update = {name: new[name] - syncer[name] for name in shapes}
        payload = publisher.encode_update(FragmentIndex(0), update, {"version": version})
        apply_update(syncer, payload, secret)
        published.append(payload)
    for learner in learners:
        for payload in published:
            apply_update(learner, payload, secret)
        for name in shapes:
            assert torch.equal(learner[name], syncer[name])
    # the update is not lost to quantization: what was applied plus the carry is what was asked
    drift = sum(float((syncer[n] - initial[n]).norm()) for n in shapes)
    assert drift > 0


def test_the_carry_holds_exactly_what_quantization_left_out(secret):
    publisher = ExactPublisher(CodecSpec(codec=Codec.INT4), secret)
    update = {"w": torch.randn(1000)}
    parameters = {"w": torch.zeros(1000)}
    apply_update(parameters, publisher.encode_update(FragmentIndex(2), update), secret)
    carry = publisher.carry_tensors()["2/w"].clone()
    assert torch.equal(parameters["w"] + carry, update["w"])
    # the next update includes the carried error
    second = {"w": torch.zeros(1000)}
    apply_update(parameters, publisher.encode_update(FragmentIndex(2), second), secret)
    assert float((parameters["w"] - update["w"]).norm()) < float(carry.norm())


def test_carries_round_trip_for_persistence(secret):
    publisher = ExactPublisher(CodecSpec(codec=Codec.INT8), secret)
    publisher.encode_update(FragmentIndex(0), {"w": torch.randn(100)})
    restored = ExactPublisher(CodecSpec(codec=Codec.INT8), secret)
    restored.load_carry_tensors(publisher.carry_tensors())
    nxt = {"w": torch.randn(100)}
    assert publisher.encode_update(FragmentIndex(0), nxt) == restored.encode_update(FragmentIndex(0), nxt)


def test_apply_update_verifies_before_touching_parameters(secret):
    from diloco_cli.codec import CorruptPayload

    payload = bytearray(encode_payload([("w", torch.ones(10))], CodecSpec(), secret))
    payload[-40] ^= 1
    parameters = {"w": torch.zeros(10)}
    with pytest.raises(CorruptPayload):
        apply_update(parameters, bytes(payload), secret)
    assert torch.equal(parameters["w"], torch.zeros(10))
