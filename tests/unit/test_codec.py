"""The codec: error bounds, determinism, exact residuals and rejection of bad frames."""

import hashlib
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco_cli.codec import (
    Codec,
    CodecSpec,
    CorruptPayload,
    NonFiniteValues,
    PayloadError,
    PayloadTooLarge,
    RunSecret,
    TruncatedPayload,
    UnsupportedFormat,
    WrongRun,
    decode_payload,
    encode_payload,
    read_header,
)
from diloco_cli.codec.frame import MAGIC, PREFIX, TAG_BYTES, PayloadLimits
from diloco_cli.codec.layout import section_layout
from diloco_cli.codec.quantize import KERNELS, dequantize_into, quantize_into

ERROR_BOUNDS = {
    Codec.FP32: 0.0,
    Codec.BF16: 0.005,
    Codec.INT8: 0.01,
    Codec.INT4: 0.12,
    Codec.INT2: 0.36,
    Codec.TOPK: 0.75,
}


def relative_error(original, decoded):
    return float((decoded - original).norm() / original.norm())


@given(
    codec=st.sampled_from(list(Codec)),
    seed=st.integers(0, 2**31 - 1),
    numel=st.integers(4096, 50_000),
    zstd_level=st.sampled_from([0, 1, 3]),
)
def test_relative_error_stays_under_the_codec_bound_on_gaussian_data(secret, codec, seed, numel, zstd_level):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    payload = encode_payload([("w", values)], CodecSpec(codec=codec, zstd_level=zstd_level), secret)
    decoded = decode_payload(payload, secret).tensors["w"]
    assert relative_error(values, decoded) <= ERROR_BOUNDS[codec]


@given(codec=st.sampled_from(list(Codec)), seed=st.integers(0, 2**31 - 1))
def test_encoding_and_decoding_are_deterministic(secret, codec, seed):
    values = torch.randn(3000, generator=torch.Generator().manual_seed(seed)) * 1e-3
    spec = CodecSpec(codec=codec)
    first, second = (encode_payload([("w", values)], spec, secret) for _ in range(2))
    assert first == second
    assert torch.equal(decode_payload(first, secret).tensors["w"], decode_payload(second, secret).tensors["w"])


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4, Codec.INT2])
@pytest.mark.parametrize("numel", [1, 3, 63, 64, 65, 1001])
def test_kernels_and_torch_reference_write_the_same_bytes(codec, numel):
    if KERNELS is None:
        pytest.fail("the C kernels are not built: the install must compile diloco_cli/codec/_kernels.c")
    values = torch.randn(numel) * 3
    values[numel // 2] = 0.0
    layout = section_layout(codec, numel, 64)
    sections, residuals, decoded = [], [], []
    for use_kernels in (True, False):
        section = np.zeros(layout.total_bytes, np.uint8)
        residual = torch.empty(numel)
        quantize_into(codec, values, 64, section, residual, use_kernels=use_kernels)
        out = torch.full((numel,), 0.25)
        dequantize_into(codec, section, numel, 64, out, accumulate=True, use_kernels=use_kernels)
        sections.append(section)
        residuals.append(residual)
        decoded.append(out)
    assert np.array_equal(*sections)
    assert torch.equal(*residuals)
    assert torch.equal(*decoded)


def test_int4_golden_block():
    """One block by hand: absmax 1.4 gives 0.2, rounded up to the bfloat16 0.2001953125;
    each value becomes the nearest level of that scale."""
    values = torch.tensor([1.4, -0.7, 0.05, 0.31, -1.4, 0.0])
    section = np.zeros(section_layout(Codec.INT4, 6, 64).total_bytes, np.uint8)
    quantize_into(Codec.INT4, values, 64, section)
    scale = 0.2001953125  # 0x3E4D0000: 0.2f is 0x3E4CCCCD, rounded up in the top 16 bits
    assert section[:2].view(np.uint16)[0] == 0x3E4D
    expected_levels = [round(v / scale) for v in [1.4, -0.7, 0.05, 0.31, -1.4, 0.0]]
    assert expected_levels == [7, -3, 0, 2, -7, 0]
    nibbles = [(int(byte) >> shift) & 15 for byte in section[2:5] for shift in (0, 4)]
    assert [n - 8 for n in nibbles] == expected_levels
    out = torch.empty(6)
    dequantize_into(Codec.INT4, section, 6, 64, out)
    assert torch.equal(out, torch.tensor(expected_levels, dtype=torch.float32) * scale)


def test_int2_golden_block():
    """One block by hand: mean |x| 0.6 gives the scale 0.4, rounded up to the bfloat16
    0.400390625; each value becomes the nearest odd level of that scale, clipped to +-3,
    four to a byte as (q + 3) / 2, the first value in the lowest bits."""
    values = torch.tensor([1.5, -0.3, 0.1, -0.5, 0.0, 1.2])
    assert abs(float(values.abs().mean()) - 0.6) < 1e-7
    section = np.zeros(section_layout(Codec.INT2, 6, 64).total_bytes, np.uint8)
    quantize_into(Codec.INT2, values, 64, section)
    scale = 0.400390625  # 0x3ECD0000: 0.4f is 0x3ECCCCCD, rounded up in the top 16 bits
    assert section[:2].view(np.uint16)[0] == 0x3ECD
    expected_levels = [3, -1, 1, -1, 1, 3]  # 1.5/s = 3.75 clips to 3; 0.0 rounds to +1 (no zero level)
    fields = [(int(byte) >> shift) & 3 for byte in section[2:4] for shift in (0, 2, 4, 6)][:6]
    assert [2 * f - 3 for f in fields] == expected_levels
    assert section_layout(Codec.INT2, 6, 64).code_bytes == 2
    out = torch.empty(6)
    dequantize_into(Codec.INT2, section, 6, 64, out)
    assert torch.equal(out, torch.tensor(expected_levels, dtype=torch.float32) * scale)


def test_int2_error_feedback_sends_the_sum_of_what_it_was_given():
    """Sent with error feedback, int2's clipping and rounding are carried, not lost: after
    T sends of the same values, what arrived sums to T times them but for one residual,
    so its relative error falls with T (one send alone loses 35%)."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    residual, arrived, errors = torch.zeros(4096), torch.zeros(4096), []
    for sends in range(1, 51):
        section = np.zeros(section_layout(Codec.INT2, 4096, 64).total_bytes, np.uint8)
        quantize_into(Codec.INT2, values + residual, 64, section, residual)
        decoded = torch.empty(4096)
        dequantize_into(Codec.INT2, section, 4096, 64, decoded)
        arrived += decoded
        errors.append(relative_error(sends * values, arrived))
    assert torch.allclose(arrived + residual, 50 * values, rtol=1e-4, atol=1e-3)
    assert errors[0] > 0.3 and errors[9] < 0.2 and errors[49] < 0.08


def test_int8_ties_round_to_even():
    values = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5])  # absmax 127: scale exactly 1.0
    section = np.zeros(section_layout(Codec.INT8, 5, 64).total_bytes, np.uint8)
    quantize_into(Codec.INT8, values, 64, section)
    assert section[2:7].view(np.int8).tolist() == [127, 0, 2, 2, 0]


@pytest.mark.parametrize("codec", list(Codec))
def test_residual_is_exactly_what_decoding_loses_even_in_place(secret, codec):
    values = torch.randn(5000)
    residual = torch.empty(5000)
    payload = encode_payload([("w", values)], CodecSpec(codec=codec), secret, residuals_into={"w": residual})
    decoded = decode_payload(payload, secret).tensors["w"]
    assert torch.equal(residual, values - decoded)
    in_place = values.clone()
    assert encode_payload([("w", in_place)], CodecSpec(codec=codec), secret, residuals_into={"w": in_place}) == payload
    assert torch.equal(in_place, residual)


def test_decoding_into_tensors_adds_or_overwrites(secret):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(17)}
    payload = encode_payload(tensors.items(), CodecSpec(codec=Codec.INT8), secret, {"learner": "x"})
    decoded = decode_payload(payload, secret)
    assert decoded.meta == {"learner": "x"}
    assert [t.shape for t in decoded.tensors.values()] == [torch.Size([3, 5]), torch.Size([17])]
    targets = {"a": torch.ones(3, 5), "b": torch.ones(17)}
    decode_payload(payload, secret, into=targets, accumulate=True)
    for name in tensors:
        assert torch.equal(targets[name], torch.ones_like(targets[name]) + decoded.tensors[name])
    with pytest.raises(CorruptPayload, match="shape"):
        decode_payload(payload, secret, into={"a": torch.ones(5, 3), "b": torch.ones(17)})


def test_non_finite_values_are_refused(secret):
    values = torch.randn(300)
    values[200] = float("nan")
    for codec in Codec:
        with pytest.raises(NonFiniteValues):
            encode_payload([("w", values)], CodecSpec(codec=codec), secret)


@pytest.fixture(scope="module")
def small_payload():
    secret = RunSecret(bytes(range(32)))
    tensors = [("layer.weight", torch.randn(40, 3)), ("layer.bias", torch.randn(5))]
    return encode_payload(tensors, CodecSpec(codec=Codec.INT4), secret, {"learner": "a", "fragment": 1})


def test_every_truncation_is_rejected(secret, small_payload):
    for length in range(len(small_payload)):
        with pytest.raises(PayloadError):
            decode_payload(small_payload[:length], secret)
    with pytest.raises(TruncatedPayload):
        decode_payload(small_payload[: len(small_payload) // 2], secret)


@given(flip=st.integers(1, 255))
def test_every_single_byte_corruption_is_rejected(secret, small_payload, flip):
    for position in range(len(small_payload)):
        corrupted = bytearray(small_payload)
        corrupted[position] ^= flip
        with pytest.raises(PayloadError):
            decode_payload(bytes(corrupted), secret)


def test_rejections_name_their_cause(secret, small_payload):
    with pytest.raises(WrongRun):
        decode_payload(small_payload, RunSecret(bytes(32)))
    with pytest.raises(CorruptPayload, match="does not start like a diloco frame"):
        decode_payload(b"PK\x03\x04" + small_payload[4:], secret)
    # a genuine frame of another format version (tagged as such) names its version
    newer = bytearray(small_payload[:-TAG_BYTES])
    newer[4:6] = struct.pack("<H", 2)
    newer += hashlib.blake2b(bytes(newer), key=secret.key, digest_size=TAG_BYTES).digest()
    with pytest.raises(UnsupportedFormat, match="version 2"):
        decode_payload(bytes(newer), secret)
    with pytest.raises(CorruptPayload, match="tag"):
        decode_payload(small_payload[:-1] + bytes([small_payload[-1] ^ 1]), secret)
    with pytest.raises(CorruptPayload):
        decode_payload(small_payload + b"\x00", secret)


def test_damaged_bytes_read_as_damaged_never_as_another_format_version(secret, small_payload):
    # the version field flipped by damage: the tag no longer verifies
    damaged = bytearray(small_payload)
    damaged[4:6] = struct.pack("<H", 11321)
    with pytest.raises(CorruptPayload, match="tag mismatch") as refused:
        decode_payload(bytes(damaged), secret)
    assert not isinstance(refused.value, UnsupportedFormat)
    # random bytes, with or without the magic in front
    noise = random.Random(7).randbytes(len(small_payload))
    for garbage in (noise, MAGIC + noise[4:]):
        with pytest.raises(PayloadError) as refused:
            decode_payload(garbage, secret)
        assert not isinstance(refused.value, UnsupportedFormat), refused.value


def test_forgery_with_the_fingerprint_but_not_the_key_is_rejected(secret, small_payload):
    """An attacker can copy the public fingerprint but cannot compute the tag."""
    forged = bytearray(small_payload)
    forged[PREFIX.size + 5] ^= 1
    with pytest.raises(CorruptPayload, match="tag"):
        decode_payload(bytes(forged), secret)


def test_absurd_sizes_are_refused_before_allocation(secret, small_payload):
    magic, version, flags, fingerprint, header_bytes, _ = PREFIX.unpack_from(small_payload)
    absurd = PREFIX.pack(magic, version, flags, fingerprint, header_bytes, 1 << 62) + small_payload[PREFIX.size :]
    with pytest.raises(PayloadTooLarge):
        decode_payload(absurd, secret)
    big = encode_payload([("w", torch.zeros(10_000))], CodecSpec(codec=Codec.INT4), secret)
    with pytest.raises(PayloadTooLarge, match="decodes to 40000 bytes"):
        decode_payload(big, secret, PayloadLimits(max_decoded_bytes=39_999))


def test_header_is_readable_without_decoding(secret, small_payload):
    header = read_header(small_payload, secret)
    assert [entry.name for entry in header.tensors] == ["layer.weight", "layer.bias"]
    assert header.codec.codec is Codec.INT4
    assert header.meta["fragment"] == 1


def test_an_empty_payload_carries_only_metadata(secret):
    payload = encode_payload([], CodecSpec(), secret, {"step": 3})
    assert decode_payload(payload, secret).tensors == {}
    assert read_header(payload, secret).meta == {"step": 3}


def test_int4_needs_an_even_block_of_at_most_256():
    with pytest.raises(ValueError, match="even block_size"):
        CodecSpec(codec=Codec.INT4, block_size=63)
    assert CodecSpec(codec=Codec.INT8, block_size=1000).block_size == 1000
    with pytest.raises(ValueError, match="multiple of 4"):
        CodecSpec(codec=Codec.INT2, block_size=66)


def test_secret_never_shows_in_its_repr():
    secret = RunSecret(bytes(range(32)))
    assert secret.key.hex() not in repr(secret) and secret.key.hex() not in str(secret)
    assert RunSecret.from_hex(secret.to_hex()) == secret


def test_declared_values_count_without_trusting():
    from diloco_cli.codec import CodecSpec, RunSecret, declared_values, encode_payload

    frame = encode_payload([("w", torch.zeros(3, 5)), ("b", torch.zeros(7))], CodecSpec(), RunSecret.generate(), {})
    assert declared_values(frame) == 22
    assert declared_values(b"junk") == 0 and declared_values(b"D" * 64) == 0


def test_kernels_compiled_from_an_older_source_give_way_to_the_torch_path(tmp_path):
    """A host that kept kernels built before a codec was added (no int2 symbols) must not
    crash at import: the codec warns, says how to rebuild, and uses the torch path."""
    import importlib.machinery
    import subprocess
    import sysconfig

    from diloco_cli.codec.quantize import _load_kernels

    source = tmp_path / "old.c"
    source.write_text("int diloco_quantize_int8(void) { return 0; }\n")
    library = tmp_path / f"_kernels{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    with pytest.warns(RuntimeWarning, match="out of date.*python -m diloco_cli.codec.build"):
        assert _load_kernels(tmp_path) is None
