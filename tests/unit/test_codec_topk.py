"""The top-k codec: a block by hand, its layout, error feedback, chunks and forged positions."""

import numpy as np
import pytest
import torch

from diloco_cli.codec import Codec, CodecSpec, CorruptPayload, decode_payload, encode_payload, read_header
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.codec.layout import section_layout
from diloco_cli.codec.quantize import dequantize_chunk, dequantize_into, quantize_chunk, quantize_into


def encoded(values, block_size, keep):
    section = np.zeros(section_layout(Codec.TOPK, values.numel(), block_size, keep).total_bytes, np.uint8)
    residual = torch.empty(values.numel())
    quantize_into(Codec.TOPK, values, block_size, section, residual, keep_per_block=keep)
    return section, residual


def test_topk_golden_block():
    """One block of 8 keeping 3: the largest magnitudes are 2.0 (position 5), -1.5 (1) and
    1.0 (6, where -1.0 at 3 ties: the lower position wins, so 3); mean 1.5, a bfloat16
    exactly; positions ascending [1, 3, 5], signs [-, -, +] as bits 0b011; the rest 0."""
    values = torch.tensor([0.1, -1.5, 0.2, -1.0, 0.0, 2.0, 1.0, -0.3])
    section, residual = encoded(values, 8, 3)
    assert section[:2].view(np.uint16)[0] == 0x3FC0  # 1.5 as a bfloat16
    assert list(section[2:5]) == [1, 3, 5]
    assert section[5] == 0b011
    assert section_layout(Codec.TOPK, 8, 8, 3).code_bytes == 4  # 3 positions, one byte of signs
    out = torch.empty(8)
    dequantize_into(Codec.TOPK, section, 8, 8, out, keep_per_block=3)
    expected = torch.tensor([0.0, -1.5, 0.0, -1.5, 0.0, 1.5, 0.0, 0.0])
    assert torch.equal(out, expected)
    assert torch.equal(residual, values - expected)


def test_topk_layout_and_payload_size():
    """1,000 values in blocks of 256 keeping 8: four blocks, 8 bytes of scales and 4 x (8
    positions + 1 byte of signs); the payload is a few percent of int8's."""
    layout = section_layout(Codec.TOPK, 1000, 256, 8)
    assert (layout.scale_bytes, layout.code_bytes, layout.total_bytes) == (8, 36, 48)
    assert section_layout(Codec.TOPK, 1000, 256, 9).code_bytes == 4 * (9 + 2)
    assert CodecSpec(codec=Codec.TOPK, block_size=256, keep_per_block=8).layout(1000) == layout


def test_topk_error_feedback_sends_everything_in_time():
    """Keeping 8 of 256 sends 3% of the values at a time; with error feedback the rest
    wait and are sent later, so that the sum of what arrived over T sends of the same
    values approaches T times them (one send alone loses 90%, 50 sends 26%, 200 sends 7%)."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    residual, arrived, errors = torch.zeros(4096), torch.zeros(4096), []
    for sends in range(1, 201):
        carried = values + residual
        section, residual = encoded(carried, 256, 8)
        decoded = torch.empty(4096)
        dequantize_into(Codec.TOPK, section, 4096, 256, decoded, keep_per_block=8)
        arrived += decoded
        errors.append(float((arrived - sends * values).norm() / (sends * values).norm()))
    assert torch.allclose(arrived + residual, 200 * values, rtol=1e-3, atol=1e-2)
    assert errors[0] > 0.85 and errors[49] < 0.3 and errors[199] < 0.1


def test_topk_chunks_at_block_boundaries_write_the_bytes_of_one_call():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    whole, whole_residual = encoded(values, 64, 5)
    pieces = np.zeros_like(whole)
    residual = torch.empty(1000)
    for start in (0, 128, 512, 960):  # the pieces, out of order
        end = {0: 128, 128: 512, 512: 960, 960: 1000}[start]
        quantize_chunk(Codec.TOPK, values[start:end], 64, pieces, 1000, start, residual[start:end], keep_per_block=5)
    assert np.array_equal(whole, pieces)
    assert torch.equal(whole_residual, residual)
    out = torch.zeros(1000)
    for start, end in ((512, 1000), (0, 512)):
        dequantize_chunk(Codec.TOPK, whole, 1000, 64, start, out[start:end], accumulate=True, keep_per_block=5)
    assert torch.equal(out, values - whole_residual)


def test_topk_through_a_payload_and_exact_publication(secret):
    """A payload names keep_per_block in its header (only top-k's do); the syncer's exact
    publication holds for top-k updates: learners applying them hold its weights."""
    spec = CodecSpec(codec=Codec.TOPK, block_size=128, keep_per_block=4)
    values = torch.randn(300, 7)
    payload = encode_payload([("w", values)], spec, secret)
    assert read_header(payload, secret).codec == spec
    assert decode_payload(payload, secret).tensors["w"].count_nonzero() == 17 * 4
    other = encode_payload([("w", values)], CodecSpec(codec=Codec.INT4), secret)
    assert b"keep_per_block" in payload and b"keep_per_block" not in other
    syncer, learner = {"w": torch.zeros(300, 7)}, {"w": torch.zeros(300, 7)}
    publisher = ExactPublisher(spec, secret)
    for version in range(1, 6):
        update = publisher.encode_update(0, {"w": torch.randn(300, 7) * 1e-2}, {"version": version})
        apply_update(syncer, update, secret)
        apply_update(learner, update, secret)
    assert torch.equal(syncer["w"], learner["w"]) and syncer["w"].count_nonzero() > 0


def test_a_position_beyond_its_block_is_refused():
    section, _ = encoded(torch.randn(64), 64, 4)
    section[2] = 200  # a forged position: the tag would have to verify for this to be read
    with pytest.raises(CorruptPayload, match="beyond its block"):
        dequantize_into(Codec.TOPK, section, 64, 64, torch.empty(64), keep_per_block=4)


def test_topk_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="at most 256"):
        CodecSpec(codec=Codec.TOPK, block_size=512)
    with pytest.raises(ValueError, match="keep_per_block 64 must be below block_size 64"):
        CodecSpec(codec=Codec.TOPK, block_size=64, keep_per_block=64)
    assert CodecSpec(codec=Codec.INT8, block_size=1000, keep_per_block=1000).block_size == 1000  # topk's alone


def test_a_topk_update_encoded_chunk_by_chunk_is_the_update_encoded_at_once(secret, monkeypatch):
    """The syncer's round encodes an update in chunks that start at multiples of the
    encoder's alignment: for top-k its block (here 100 values, which divides no chunk of
    the kernels' power-of-two sizes), so no chunk starts inside a block."""
    from diloco_cli.codec import parallel
    from diloco_cli.core.types import FragmentIndex

    monkeypatch.setattr(parallel, "CHUNK_VALUES", 256)
    spec = CodecSpec(codec=Codec.TOPK, block_size=100, keep_per_block=3)
    update = torch.randn(2000, generator=torch.Generator().manual_seed(5))
    chunked = ExactPublisher(spec, secret).update_encoder(FragmentIndex(0), {"w": (2000,)})
    assert chunked.block_size == 100
    for start, length in parallel.chunk_bounds(2000, chunked.block_size):
        chunked.encode("w", start, update[start : start + length])
    whole = ExactPublisher(spec, secret).update_encoder(FragmentIndex(0), {"w": (2000,)})
    whole.encode("w", 0, update)
    assert np.array_equal(chunked.body().raw, whole.body().raw)
