"""Every reader of untrusted bytes, fuzzed with hypothesis: the payload frame, the sealed
documents, the run manifest and the dataset index raise nothing but their typed errors
(``PayloadError`` and its subclasses, ``DamagedDocument``/``ForgedDocument``,
``ManifestError``, ``DatasetError``), whatever the bytes.

The targets, seeds and mutations are those of ``tests/fuzz.py`` (which runs them for
minutes); here a few hundred inputs each, drawn by hypothesis so that a failure shrinks
and replays.  Each defect found is kept as an ``@example``.
"""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from diloco_cli.codec import CorruptPayload, PayloadTooLarge, declared_values, decode_payload
from diloco_cli.codec.frame import PREFIX
from tests.fuzz import BODY_LENGTHS, HEADER_LENGTHS, SECRET, TARGETS, attempt, mutate, resigned_frame

TARGET = {target.name: target for target in TARGETS}
FRAME_READERS = ("frame.decode_payload", "frame.read_header", "frame.declared_values")
SEEDS = {target.name: target.seeds() for target in TARGETS}

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def assert_typed(name: str, data: bytes) -> None:
    target = TARGET[name]
    error = attempt(target, data)
    if error is None or isinstance(error, target.typed):
        return
    raise AssertionError(f"{name} let {type(error).__name__} escape on {data[:200]!r}: {error}") from error


def fp32_header(raw_body_bytes: int, shape: list[int], zstd_level: int = 0) -> bytes:
    codec = {"codec": "fp32", "block_size": 64, "zstd_level": zstd_level}
    return json.dumps(
        {
            "codec": codec,
            "raw_body_bytes": raw_body_bytes,
            "tensors": [{"name": "w", "shape": shape, "dtype": "float32"}],
            "meta": {},
        }
    ).encode()


def lying_zstd(content_size: int) -> bytes:
    """A zstandard frame whose header declares ``content_size`` bytes and holds none."""
    return bytes.fromhex("28b52ffd") + bytes([0xE0]) + struct.pack("<Q", content_size) + bytes([1, 0, 0])


# ------------------------------------------------------------------------------ frames


@FUZZ
@given(st.binary(max_size=300))
@example(b"DLCO")
@example(PREFIX.pack(b"DLCO", 1, 0, SECRET.fingerprint, 0xFFFF_FFFF, (1 << 64) - 1))
def test_random_bytes_are_refused_as_payload_errors(data):
    for name in FRAME_READERS:
        assert_typed(name, data)


@FUZZ
@given(st.sampled_from(range(len(SEEDS["frame.decode_payload"]))), st.randoms(use_true_random=False))
def test_mutated_frames_are_refused_as_payload_errors(seed, rng):
    data = mutate(rng, TARGET["frame.decode_payload"], [SEEDS["frame.decode_payload"][seed]])
    for name in FRAME_READERS:
        assert_typed(name, data)


@FUZZ
@given(
    st.sampled_from(range(len(SEEDS["frame.decode_payload"]))),
    st.sampled_from(HEADER_LENGTHS) | st.integers(0, (1 << 32) - 1),
    st.sampled_from(BODY_LENGTHS) | st.integers(0, (1 << 64) - 1),
)
def test_extreme_declared_lengths_are_refused_before_anything_is_allocated(seed, header_bytes, body_bytes):
    frame = SEEDS["frame.decode_payload"][seed]
    magic, version, flags, fingerprint, real_header, real_body = PREFIX.unpack_from(frame)
    if (header_bytes, body_bytes) == (real_header, real_body):
        return
    data = PREFIX.pack(magic, version, flags, fingerprint, header_bytes, body_bytes) + frame[PREFIX.size :]
    for name in FRAME_READERS:
        assert_typed(name, data)
    with pytest.raises(Exception) as refused:
        decode_payload(data, SECRET)
    assert isinstance(refused.value, TARGET["frame.decode_payload"].typed)


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
SHAPES = st.lists(st.integers(-3, 1 << 40) | st.sampled_from([0, 1, 2, 4, 8]), max_size=3)
HEADERS = st.fixed_dictionaries(
    {
        "codec": st.fixed_dictionaries(
            {
                "codec": st.sampled_from(["fp32", "bf16", "int8", "int4", "int2"]),
                "block_size": st.sampled_from([2, 8, 64, 257, 0, -2]),
                "zstd_level": st.sampled_from([0, 1, 23]),
            }
        ),
        "raw_body_bytes": st.integers(-8, 1 << 40) | st.sampled_from([0, 8, 16, 32]),
        "tensors": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["w", "b", ""]), "shape": SHAPES, "dtype": st.text(max_size=8)}
            ),
            max_size=3,
        ),
        "meta": st.dictionaries(st.text(max_size=8), JSON_SCALARS, max_size=3),
    }
)


@FUZZ
@given(HEADERS, st.binary(max_size=64))
@example(json.loads(fp32_header(0, [-1])), b"")  # was: RuntimeError from torch.empty
@example(json.loads(fp32_header(60 << 30, [15 << 30], zstd_level=1)), lying_zstd(60 << 30))  # was: MemoryError
def test_headers_that_only_the_runs_key_could_sign_are_refused_as_payload_errors(header, body):
    """Past the tag: whatever the authenticated header says, decoding raises a
    PayloadError (a learner's bug must not crash the syncer with anything else)."""
    encoded = json.dumps(header).encode()
    assert_typed("frame.decode_payload (re-tagged)", encoded + b"\0" + body)
    assert declared_values(resigned_frame(encoded, body)) >= 0


def test_negative_shapes_and_lying_content_sizes_are_refused_with_their_cause():
    with pytest.raises(CorruptPayload, match="does not parse"):
        decode_payload(resigned_frame(fp32_header(0, [-1]), b""), SECRET)
    assert declared_values(resigned_frame(fp32_header(0, [2, -3]), b"")) == 0
    header = fp32_header(60 << 30, [15 << 30], zstd_level=1)
    with pytest.raises((PayloadTooLarge, CorruptPayload)):  # too large where 60 GiB cannot be allocated
        decode_payload(resigned_frame(header, lying_zstd(60 << 30)), SECRET)


@FUZZ
@given(st.sampled_from(range(len(SEEDS["frame.decode_payload (re-tagged)"]))), st.randoms(use_true_random=False))
def test_mutated_headers_under_a_valid_tag_are_refused_as_payload_errors(seed, rng):
    target = TARGET["frame.decode_payload (re-tagged)"]
    assert_typed(target.name, mutate(rng, target, [SEEDS[target.name][seed]]))


# --------------------------------------------------------------------------- documents


@FUZZ
@given(st.sampled_from(range(len(SEEDS["documents.unseal"]))), st.randoms(use_true_random=False))
@example(0, None)
def test_mutated_documents_are_refused_as_damaged_or_forged(seed, rng):
    target = TARGET["documents.unseal"]
    assert_typed(
        target.name, SEEDS[target.name][seed] if rng is None else mutate(rng, target, [SEEDS[target.name][seed]])
    )


@FUZZ
@given(
    st.binary(max_size=200)
    | st.recursive(
        JSON_SCALARS,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    ).map(lambda value: json.dumps({"document": value, "tag": "0" * 64}).encode())
)
@example(b'{"document": ' + b"[" * 100_000)  # was: RecursionError
@example('{"document": {}, "tag": "\u00e9"}'.encode())  # was: TypeError from hmac.compare_digest
@example(b'{"document": {}, "tag": "\\ud800"}')
def test_any_stored_bytes_are_refused_as_damaged_or_forged(data):
    assert_typed("documents.unseal", data)


DOCUMENT_BODIES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                ["version", "learner", "state", "recent", "counts", "fragment_versions", "0", "epoch", "x"]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=20,
)


@FUZZ
@given(DOCUMENT_BODIES)
def test_authentic_documents_of_any_shape_are_refused_as_damaged(body):
    """Sealed with the run's key, so only validation stands between the body and a reader."""
    assert_typed("documents.unseal (re-sealed)", json.dumps(body).encode())


@FUZZ
@given(st.sampled_from(range(len(SEEDS["documents.unseal (re-sealed)"]))), st.randoms(use_true_random=False))
def test_authentic_documents_mutated_deep_inside_are_refused_as_damaged(seed, rng):
    target = TARGET["documents.unseal (re-sealed)"]
    assert_typed(target.name, mutate(rng, target, [SEEDS[target.name][seed]]))


# ---------------------------------------------------------------- manifest and index


@FUZZ
@given(st.sampled_from(["run_spec.read_run_spec", "datasets.parse_index"]), st.randoms(use_true_random=False))
def test_mutated_manifests_and_indexes_raise_their_typed_errors(name, rng):
    target = TARGET[name]
    assert_typed(name, mutate(rng, target, SEEDS[name]))


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("run_spec.read_run_spec", b"[" * 100_000),
        ("datasets.parse_index", b"[" * 100_000),
        ("datasets.parse_index", b'{"vocab_size": ' + b"9" * 5000 + b"}"),
    ],
    ids=["manifest-deep-nesting", "index-deep-nesting", "index-5000-digit-number"],
)
def test_what_the_fuzzer_found_in_the_manifest_and_index_readers_is_typed(name, data):
    error = attempt(TARGET[name], data)
    assert error is None or isinstance(error, TARGET[name].typed), f"{type(error).__name__}: {error}"
