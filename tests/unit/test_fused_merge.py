"""The fused, threaded merge round against the reference path of torch ops.

The reference is what a round computed before the kernels were fused: decode each payload
onto a copy of its drift, fold it into the accumulator with torch ops (``add_`` and a
norm), take the outer step on whole tensors, encode the update, apply its payload.  The
fused round must give the same merged values within float rounding (the norms are summed
in float64 in another order, fresh arrivals first), and the same bits for any number of
threads and for a workspace reused round after round.
"""

import pytest
import torch

from diloco_cli.codec import Codec, CodecSpec, CorruptPayload, decode_payload, encode_payload, parallel
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.codec.quantize import KERNELS
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator, token_weight
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.runtime import outer_gradients
from diloco_cli.runtime.syncer.merge_round import RoundInput, merge_round
from diloco_cli.runtime.workspace import MergeWorkspace

needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C kernels are not built")

SHAPES = {"embed": (37, 16), "w": (129, 31), "b": (7,)}
"""Sizes that are not multiples of a block, a chunk or a vector (all cut into several
chunks once CHUNK_VALUES is small)."""

RELATIVE_TOLERANCE = 1e-5
"""Fused against reference: float rounding of fp32 sums whose norms were taken in
another order (float64 against torch's fp32), relative to the merged tensor's norm."""


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 256 values, so that every tensor here spans several, and payloads
    opened ahead on the background thread however small the fragment."""
    monkeypatch.setattr(parallel, "CHUNK_VALUES", 256)
    monkeypatch.setattr(outer_gradients, "PREFETCH_VALUES", 0)


def delta(seed, scale=1e-2):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in SHAPES.items()}


def payload(secret, learner, base, values, spec):
    meta = {"learner": learner, "fragment": 0, "base_version": base}
    return encode_payload(values.items(), spec, secret, meta)


def assert_close(found, expected):
    for name in expected:
        scale = float(expected[name].norm()) or 1.0
        difference = float((found[name] - expected[name]).norm())
        assert difference <= RELATIVE_TOLERANCE * scale, (name, difference, scale)


def test_payloads_opened_ahead_are_refused_or_fail_as_when_opened_in_turn(secret, small_chunks):
    """On the background thread: a payload without every tensor of the fragment, or
    with a damaged tag, is refused; a load that fails stops the round with its error."""
    parameters = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    partial = {name: values for name, values in delta(5).items() if name != "b"}
    damaged = bytearray(payload(secret, "c", 0, delta(7), CodecSpec()))
    damaged[-1] ^= 0xFF

    def merge(*arrivals):
        return merge_round(
            FragmentIndex(0),
            Version(1),
            [RoundInput(LearnerId(learner), Version(0), 1, 1, load) for learner, load in arrivals],
            parameters,
            UpdateWindow(2),
            NesterovOuterOptimizer(1.0, 0.0),
            ExactPublisher(CodecSpec(codec=Codec.INT8), secret),
            secret,
            workspace=MergeWorkspace(2),
        )

    result = merge(
        ("a", lambda: payload(secret, "a", 0, delta(6), CodecSpec())),
        ("b", lambda: payload(secret, "b", 0, partial, CodecSpec())),
        ("c", lambda: bytes(damaged)),
    )
    assert [a.learner for a in result.merged] == ["a"]
    assert [type(error) for _, error in result.rejected] == [CorruptPayload, CorruptPayload]

    def unreadable():
        raise OSError("the bucket is gone")

    with pytest.raises(OSError, match="the bucket is gone"):
        merge(("a", lambda: payload(secret, "a", 0, delta(6), CodecSpec())), ("b", unreadable))


INT8_UPDATES = CodecSpec(codec=Codec.INT8, block_size=48)
EXACT_UPDATES = CodecSpec(codec=Codec.FP32)
"""For comparing with the reference: a rounding difference in a merged value may flip a
code of an int8 update (by one quantization step, carried into the next update), so the
paths are compared through updates published exactly."""


def rounds(secret, workspace, versions=4, learners=3, spec=CodecSpec(codec=Codec.INT4), update_spec=INT8_UPDATES):
    """Rounds like the benchmark's: every other learner one version behind, so half the
    arrivals are anchored on a drift; learner 2 sends nothing (weight 0) in round 3."""
    parameters = {
        name: torch.randn(shape, generator=torch.Generator().manual_seed(7)) for name, shape in SHAPES.items()
    }
    window, optimizer = UpdateWindow(3), NesterovOuterOptimizer(0.7, 0.9)
    publisher = ExactPublisher(update_spec, secret)
    payloads = []
    for version in range(1, versions + 1):
        arrivals = []
        for m in range(learners):
            base = max(0, version - 1 - m % 2)
            tokens = 0 if (m == 2 and version == 3) else 100 + 10 * m
            body = payload(secret, f"m{m}", base, delta(100 * version + m), spec)
            arrivals.append(RoundInput(LearnerId(f"m{m}"), Version(base), 5, tokens, lambda body=body: body))
        result = merge_round(
            FragmentIndex(0),
            Version(version),
            arrivals,
            parameters,
            window,
            optimizer,
            publisher,
            secret,
            mean_names={"embed"},
            workspace=workspace,
        )
        payloads.append(result.payload)
    return parameters, payloads, optimizer, publisher


@needs_kernels
def test_the_thread_count_does_not_change_a_round(secret, small_chunks):
    """1, 2 and 3 threads: the same parameters, updates, momentum and carries, bit for
    bit (and, zstandard's workers writing the same frames for any number, the same bytes)."""
    outcomes = [rounds(secret, MergeWorkspace(threads)) for threads in (1, 2, 3)]
    reference_parameters, reference_payloads, reference_optimizer, reference_publisher = outcomes[0]
    for parameters, payloads, optimizer, publisher in outcomes[1:]:
        for name in SHAPES:
            assert torch.equal(parameters[name], reference_parameters[name])
        assert payloads == reference_payloads
        for mine, theirs in zip(
            (optimizer.state_tensors(), publisher.carry_tensors()),
            (reference_optimizer.state_tensors(), reference_publisher.carry_tensors()),
        ):
            assert all(torch.equal(mine[key], theirs[key]) for key in theirs)


@needs_kernels
def test_a_workspace_reused_round_after_round_gives_what_fresh_buffers_give(secret, small_chunks):
    reused = rounds(secret, MergeWorkspace(2))
    fresh = rounds(secret, None)
    for name in SHAPES:
        assert torch.equal(reused[0][name], fresh[0][name])


def reference_rounds(secret, versions=4, learners=3, spec=CodecSpec(codec=Codec.INT4), update_spec=EXACT_UPDATES):
    """The same rounds with the reference path: torch ops on whole tensors."""
    parameters = {
        name: torch.randn(shape, generator=torch.Generator().manual_seed(7)) for name, shape in SHAPES.items()
    }
    optimizer = NesterovOuterOptimizer(0.7, 0.9)
    publisher = ExactPublisher(update_spec, secret)
    updates: dict[int, bytes] = {}
    for version in range(1, versions + 1):
        accumulator = MergeAccumulator(SHAPES, {"embed"})
        for m in range(learners):
            base = max(0, version - 1 - m % 2)
            tokens = 0 if (m == 2 and version == 3) else 100 + 10 * m
            outer = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
            for later in range(base + 1, version):  # the drift Theta_now - Theta^base
                decode_payload(updates[later], secret, into=outer, accumulate=True)
            decode_payload(
                payload(secret, f"m{m}", base, delta(100 * version + m), spec), secret, into=outer, accumulate=True
            )
            accumulator.add(outer, token_weight(tokens, 5))
        update = optimizer.step(FragmentIndex(0), parameters, accumulator.result())
        for name, tensor in update.items():
            tensor.sub_(parameters[name])
        updates[version] = publisher.encode_update(FragmentIndex(0), update, {"version": version})
        apply_update(parameters, updates[version], secret)
    return parameters


@needs_kernels
def test_fused_rounds_equal_the_reference_path_within_rounding(secret, small_chunks):
    fused, *_ = rounds(secret, MergeWorkspace(3), update_spec=EXACT_UPDATES)
    reference = reference_rounds(secret)
    start = {name: torch.randn(shape, generator=torch.Generator().manual_seed(7)) for name, shape in SHAPES.items()}
    # compare what the rounds moved, not the parameters themselves
    assert_close({n: fused[n] - start[n] for n in SHAPES}, {n: reference[n] - start[n] for n in SHAPES})


def test_a_learner_replaying_threaded_rounds_matches_the_syncer(secret, small_chunks):
    parameters, payloads, *_ = rounds(secret, MergeWorkspace(3))
    learner = {name: torch.randn(shape, generator=torch.Generator().manual_seed(7)) for name, shape in SHAPES.items()}
    for update in payloads:
        apply_update(learner, update, secret)
    for name in SHAPES:
        assert torch.equal(learner[name], parameters[name])
