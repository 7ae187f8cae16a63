"""The fused fold kernels and the chunked codec against the torch reference.

The reference is what a merge computed before the kernels were fused: decode a payload
onto a copy of its drift, then ``add_`` it into the sums and take its norm with torch.
The fused kernels must give the same bits for the sums (each product rounded to fp32
before it is added, as the reference does), the norm within float64 rounding, and the
same bits for any number of threads; the torch fallback the same bits as the kernels.
"""

import pytest
import torch

from diloco_cli.codec import Codec, CodecSpec, decode_payload, encode_payload, parallel
from diloco_cli.codec.fold import AnchoredPayload, norm
from diloco_cli.codec.frame import open_payload
from diloco_cli.codec.layout import section_layout
from diloco_cli.codec.parallel import KernelPool
from diloco_cli.codec.quantize import KERNELS, dequantize_into, quantize_into

needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C kernels are not built")

SHAPES = {"embed": (37, 16), "w": (129, 31), "b": (7,)}
"""Sizes that are not multiples of a block, a chunk or a vector (each cut into several
chunks once CHUNK_VALUES is small)."""


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 256 values, so that every tensor here spans several."""
    monkeypatch.setattr(parallel, "CHUNK_VALUES", 256)


def delta(seed, scale=1e-2):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in SHAPES.items()}


def payload(secret, learner, base, values, spec):
    meta = {"learner": learner, "fragment": 0, "base_version": base}
    return encode_payload(values.items(), spec, secret, meta)


@needs_kernels
@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("with_drift", [False, True])
def test_fused_fold_equals_decoding_onto_the_drift_and_adding(secret, small_chunks, codec, with_drift):
    spec = CodecSpec(codec=codec, block_size=32)
    body = open_payload(payload(secret, "a", 0, delta(1), spec), secret)
    drift = delta(2, 1e-3) if with_drift else None
    anchored = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    if drift is not None:
        for name in anchored:
            anchored[name].copy_(drift[name])
    decode_payload(payload(secret, "a", 0, delta(1), spec), secret, into=anchored, accumulate=True)
    fused = AnchoredPayload(body, drift, KernelPool(3))
    for name, reference in anchored.items():
        exact_norm = float(torch.linalg.vector_norm(reference, dtype=torch.float64))  # both paths sum in float64
        assert fused.norm(name) == pytest.approx(exact_norm, rel=1e-9)
        weighted, unit = torch.full(SHAPES[name], 0.25), torch.full(SHAPES[name], -0.5)
        fused.fold(name, weighted, 3.0, unit, 0.7)
        # the products rounded to fp32 before they are added: the reference's bits
        assert torch.equal(weighted, torch.full(SHAPES[name], 0.25) + reference * 3.0)
        assert torch.equal(unit, torch.full(SHAPES[name], -0.5) + reference * 0.7)
        fused.fold(name, weighted, 2.0, None, overwrite_weighted=True)
        assert torch.equal(weighted, reference * 2.0)


@needs_kernels
@pytest.mark.parametrize("codec", [Codec.INT4, Codec.INT2])
@pytest.mark.parametrize("with_drift", [False, True])
def test_kernels_and_torch_fallback_agree(secret, small_chunks, with_drift, codec):
    spec = CodecSpec(codec=codec)
    body = open_payload(payload(secret, "a", 0, delta(3), spec), secret)
    drift = delta(4, 1e-3) if with_drift else None
    kernels, torch_path = AnchoredPayload(body, drift, KernelPool(2)), AnchoredPayload(body, drift, use_kernels=False)
    for name, shape in SHAPES.items():
        assert kernels.norm(name) == pytest.approx(torch_path.norm(name), rel=1e-12)
        sums = [(torch.ones(shape), torch.ones(shape)) for _ in range(2)]
        for gradients, (weighted, unit) in zip((kernels, torch_path), sums):
            gradients.fold(name, weighted, 1.5, unit, 4.0, overwrite_unit=True)
        assert torch.equal(sums[0][0], sums[1][0]) and torch.equal(sums[0][1], sums[1][1])
    values = torch.randn(10_000)
    assert norm(values, KernelPool(3)) == pytest.approx(norm(values, use_kernels=False), rel=1e-12)


@needs_kernels
@pytest.mark.parametrize(("codec", "block_size", "numel"), [(Codec.INT8, 100, 5_001), (Codec.INT4, 64, 4_097)])
def test_chunked_codec_writes_the_bytes_of_one_call(small_chunks, codec, block_size, numel):
    values = torch.randn(numel)
    layout = section_layout(codec, numel, block_size)
    outputs = []
    for pool in (KernelPool(1), KernelPool(3)):
        section, residual = torch.zeros(layout.total_bytes, dtype=torch.uint8).numpy(), torch.empty(numel)
        quantize_into(codec, values, block_size, section, residual, pool=pool)
        decoded = torch.ones(numel)
        dequantize_into(codec, section, numel, block_size, decoded, accumulate=True, pool=pool)
        outputs.append((section.tobytes(), residual, decoded))
    reference = torch.zeros(layout.total_bytes, dtype=torch.uint8).numpy()
    quantize_into(codec, values, block_size, reference, use_kernels=False)
    assert outputs[0][0] == outputs[1][0] == reference.tobytes()
    assert torch.equal(outputs[0][1], outputs[1][1]) and torch.equal(outputs[0][2], outputs[1][2])
