"""A codec is one module and one registry line: the toy codec below, registered here and
touching no other file, round-trips a payload (with error feedback, exact publication
and a merge's fold) and is sized and weighed by ``diloco plan`` like a built-in one."""

import json

import numpy as np
import pytest
import torch

from diloco_cli.codec import Codec, CodecSpec, NonFiniteValues, decode_payload, encode_payload, register_codec, registry
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.codec.fold import AnchoredPayload
from diloco_cli.codec.frame import PREFIX, open_payload
from diloco_cli.codec.layout import SectionLayout
from diloco_cli.core.types import FragmentIndex

# ------------------------------------------------------------------------ the toy codec


class HalfCodec:
    """Each value as an IEEE float16: no blocks, no scales, no kernels."""

    kernel = None
    fold_kind = None
    kernel_constants = {}
    extra_parameters = ()
    offered_by_plan = True

    def check(self, spec):
        if spec.zstd_level > 3:
            raise ValueError(f"half compresses at zstd_level 3 at most, got {spec.zstd_level}")

    def layout(self, numel, spec):
        return SectionLayout(0, 2 * numel)

    def alignment(self, spec):
        return 1

    def density(self, spec):
        return 1.0

    def encode(self, values, scales, codes, residual, spec, first_block):
        stored = values.to(torch.float16)
        if not bool(torch.isfinite(stored).all()):
            raise NonFiniteValues("a tensor holds values beyond float16")
        torch.from_numpy(codes[: 2 * values.numel()]).copy_(stored.view(torch.uint8))
        if residual is not None:
            torch.sub(values, stored.to(torch.float32), out=residual)

    def decode(self, scales, codes, out, spec, *, accumulate):
        stored = torch.from_numpy(np.array(codes[: 2 * out.numel()])).view(torch.float16).to(torch.float32)
        if accumulate:
            out.add_(stored)
        else:
            out.copy_(stored)


@pytest.fixture
def half(monkeypatch):
    """The toy codec registered as ``half`` for one test (the registry restored after it)."""
    monkeypatch.setattr(registry, "known_codecs", dict(registry.known_codecs))
    register_codec("half", HalfCodec())
    return Codec("half")


SHAPES = {"w": (37, 19), "b": (5,)}


def values(seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) * scale for name, shape in SHAPES.items()}


# ---------------------------------------------------------------------------- payloads


def test_a_registered_codec_round_trips_a_payload(secret, half):
    assert half in list(Codec) and CodecSpec.model_validate({"codec": "half"}).codec is half
    with pytest.raises(ValueError, match="zstd_level 3 at most"):
        CodecSpec(codec="half", zstd_level=9)
    with pytest.raises(ValueError, match="already registered"):
        register_codec("half", HalfCodec())
    original = values(1)
    residual = {name: torch.empty(shape) for name, shape in SHAPES.items()}
    payload = encode_payload(original.items(), CodecSpec(codec="half"), secret, {"k": 1}, residuals_into=residual)
    header = json.loads(payload[PREFIX.size : PREFIX.size + PREFIX.unpack_from(payload)[4]])
    assert header["codec"] == {"codec": "half", "block_size": 64, "zstd_level": 1}
    assert header["raw_body_bytes"] == 1408 + 16  # 2 bytes a value, each section padded to 8 bytes
    decoded = decode_payload(payload, secret)
    assert decoded.header.codec.codec is half
    for name, tensor in original.items():
        assert torch.equal(decoded.tensors[name], tensor.to(torch.float16).to(torch.float32))
        assert torch.equal(residual[name], tensor - decoded.tensors[name])
    too_large = {"w": torch.full((37, 19), 1e6), "b": torch.zeros(5)}
    with pytest.raises(NonFiniteValues):
        encode_payload(too_large.items(), CodecSpec(codec="half"), secret)


def test_a_registered_codec_publishes_exactly_and_folds_into_a_merge(secret, half):
    spec = CodecSpec(codec="half", zstd_level=0)
    publisher = ExactPublisher(spec, secret)
    syncer, learner = values(2), values(2)
    for version in range(3):
        payload = publisher.encode_update(FragmentIndex(0), values(10 + version, 1e-3), {"version": version})
        apply_update(syncer, payload, secret)
        apply_update(learner, payload, secret)
    assert all(torch.equal(syncer[name], learner[name]) for name in SHAPES)
    payload = encode_payload(values(3, 1e-2).items(), spec, secret)
    drift = values(4, 1e-3)
    anchored = {name: drift[name].clone() for name in SHAPES}
    decode_payload(payload, secret, into=anchored, accumulate=True)
    folded = AnchoredPayload(open_payload(payload, secret), drift)
    for name, reference in anchored.items():
        assert folded.norm(name) == pytest.approx(float(torch.linalg.vector_norm(reference, dtype=torch.float64)))
        weighted = torch.full(SHAPES[name], 0.5)
        folded.fold(name, weighted, 3.0)
        assert torch.equal(weighted, torch.full(SHAPES[name], 0.5) + reference * 3.0)


# -------------------------------------------------------------------------------- plan


def test_a_registered_codec_is_sized_for_the_plan_from_its_layout(secret, half):
    """A fragment too large to encode whole is sized from the codec's layout: without
    zstandard, exactly the bytes of the real payload."""
    from diloco_cli.bandwidth.measure import EXACT_VALUES, Sizer

    fragment = [("embed", (300, 250)), ("bias", (7,))]
    assert 300 * 250 > EXACT_VALUES
    spec = CodecSpec(codec="half", zstd_level=0)
    meta = {"learner": "east-0", "fragment": 1}
    sized, _ = Sizer(secret).measure("upload", fragment, spec, meta)
    real = encode_payload(((name, torch.zeros(shape)) for name, shape in fragment), spec, secret, meta)
    assert sized == len(real)


def test_a_registered_codec_is_weighed_by_the_plan(half):
    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan, weighed_codecs
    from diloco_cli.config.recipe import Recipe

    assert weighed_codecs() == ("fp32", "bf16", "half", "int8", "int4")  # heaviest first: 2 bytes a value
    recipe = Recipe().model_dump(mode="json")
    for key in ("learner_codec", "update_codec"):
        recipe["sync"][key] = {"codec": "half", "zstd_level": 0}
    plan = build_traffic_plan(Recipe.model_validate(recipe), parameters=100_000, step_seconds=1.0)
    assert plan.shape.uploads.codec == plan.shape.updates.codec == "half"
    for numel, upload, update in zip(plan.fragment_parameters, plan.shape.uploads.bytes, plan.shape.updates.bytes):
        assert 2 * numel < upload < 2 * numel + 1000 and 2 * numel < update < 2 * numel + 1000
    assert ("half", "half") in [(o.upload_codec, o.update_codec) for o in plan.suggestion.options]
