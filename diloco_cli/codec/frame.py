"""The payload frame: a fixed prefix, a JSON header, the body and a keyed BLAKE2b tag.

::

    offset  size  field
    0       4     magic b"DLCO"
    4       2     format version (little-endian)
    6       2     flags (0)
    8       8     run fingerprint (RunSecret.fingerprint)
    16      4     header length H
    20      8     body length L
    28      H     header: UTF-8 JSON (codec, tensors with shapes and dtypes, metadata)
    28+H    L     body: per tensor a section [scales][codes], zstandard-compressed
    28+H+L  32    tag: BLAKE2b keyed with the run secret over everything before it

Decoding checks, in order: the magic, the declared sizes against the limits and the
actual length, then the tag (a wrong fingerprint names another run's secret); only then
the format version and flags, so that damaged bytes read as damaged, not as another
version.  Only a payload whose tag verifies is parsed further, and the body is
decompressed with a hard output limit.  JSON
is the only structured data, so nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import math
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import zstandard
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_cli.codec.errors import (
    CorruptPayload,
    PayloadTooLarge,
    TruncatedPayload,
    UnsupportedFormat,
    WrongRun,
)
from diloco_cli.codec.secret import RunSecret
from diloco_cli.codec.spec import CodecSpec

if TYPE_CHECKING:
    import numpy as np
    import torch

    from diloco_cli.codec.parallel import KernelPool

# numpy, torch and the quantization kernels are imported where tensors are encoded or
# decoded, so that what only verifies frames and reads headers (the CLI, status) starts fast.

MAGIC = b"DLCO"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHH8sIQ")
TAG_BYTES = 32

_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class PayloadLimits:
    """Sizes beyond which a frame is refused before anything is allocated for it."""

    max_header_bytes: int = 16 << 20
    max_body_bytes: int = 64 << 30
    max_decoded_bytes: int = 64 << 30


DEFAULT_LIMITS = PayloadLimits()


class TensorEntry(BaseModel):
    """One tensor of a payload, in body order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape: tuple[Annotated[int, Field(ge=0)], ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class PayloadHeader(BaseModel):
    """The authenticated header of a payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    codec: CodecSpec
    raw_body_bytes: int
    tensors: tuple[TensorEntry, ...]
    meta: dict[str, Any]

    def section_sizes(self) -> list[int]:
        """Byte size of each tensor's section in the uncompressed body."""
        return [self.codec.layout(entry.numel).total_bytes for entry in self.tensors]


@dataclass(frozen=True)
class DecodedPayload:
    """A verified payload: its header and its tensors (fp32, CPU, original shapes)."""

    header: PayloadHeader
    tensors: dict[str, torch.Tensor]

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta


def _dtype_name(dtype: torch.dtype) -> str:
    import torch

    for name in _DTYPES:
        if getattr(torch, name) == dtype:
            return name
    raise TypeError(f"payloads carry floating-point tensors, not {dtype}")


@dataclass(frozen=True)
class PayloadBody:
    """A payload's header and its uncompressed body, one section per tensor in header
    order: read from a verified frame (:func:`open_payload`) or just quantized here
    (:func:`quantize_body`), and so trusted either way."""

    header: PayloadHeader
    raw: np.ndarray
    """The whole body (uint8); ``sections`` are views of it."""
    sections: tuple[np.ndarray, ...]
    header_json: bytes = b""
    """The header as it is tagged, for :func:`seal` (empty for an opened frame)."""

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta

    def section(self, name: str) -> tuple[TensorEntry, np.ndarray]:
        """The entry and section of tensor ``name`` (KeyError if the payload lacks it)."""
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, tuple[TensorEntry, np.ndarray]]:
        return {entry.name: (entry, section) for entry, section in zip(self.header.tensors, self.sections)}

    def decode_into(
        self, targets: Mapping[str, torch.Tensor], *, accumulate: bool = False, pool: KernelPool | None = None
    ) -> None:
        """Write (or, with ``accumulate``, add) every tensor into the tensor of its name
        in ``targets`` (contiguous fp32 CPU, checked by :func:`decode_payload`)."""
        from diloco_cli.codec.parallel import SERIAL
        from diloco_cli.codec.quantize import dequantize_into

        for entry, section in zip(self.header.tensors, self.sections):
            dequantize_into(
                self.header.codec.codec,
                section,
                entry.numel,
                self.header.codec.block_size,
                targets[entry.name].view(-1),
                accumulate=accumulate,
                keep_per_block=self.header.codec.keep_per_block,
                pool=pool or SERIAL,
            )


def encode_payload(
    tensors: Iterable[tuple[str, torch.Tensor]],
    spec: CodecSpec,
    secret: RunSecret,
    meta: Mapping[str, Any] | None = None,
    *,
    residuals_into: Mapping[str, torch.Tensor] | None = None,
) -> bytes:
    """Encode named tensors into one authenticated payload.

    ``tensors`` is consumed one at a time (a generator may compute each on demand), so a
    fragment is encoded without a copy of the whole model.  With ``residuals_into`` the
    quantization error ``x - decode(encode(x))`` of each tensor is written into the
    tensor of the same name there: error feedback's memory for the next send.  A
    residual may be the very tensor being encoded (each value is read before its
    residual is written), which saves a copy.
    """
    return seal(quantize_body(tensors, spec, meta, residuals_into=residuals_into), secret)


def quantize_body(
    tensors: Iterable[tuple[str, torch.Tensor]],
    spec: CodecSpec,
    meta: Mapping[str, Any] | None = None,
    *,
    residuals_into: Mapping[str, torch.Tensor] | None = None,
) -> PayloadBody:
    """The first half of :func:`encode_payload`: quantize ``tensors`` into a body, to be
    sealed by :func:`seal`."""
    import numpy as np
    import torch

    from diloco_cli.codec.quantize import quantize_into

    sections: list[np.ndarray] = []
    entries: list[dict[str, Any]] = []
    for name, tensor in tensors:
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
        (section,) = empty_body(spec, [values.numel()])[1]
        residual = None
        if residuals_into is not None:
            residual = residuals_into[name]
            if residual.dtype != torch.float32 or residual.device.type != "cpu" or not residual.is_contiguous():
                raise ValueError(f"the residual for {name!r} must be a contiguous fp32 CPU tensor")
            residual = residual.view(-1)
        quantize_into(spec.codec, values, spec.block_size, section, residual, keep_per_block=spec.keep_per_block)
        entries.append({"name": name, "shape": list(tensor.shape), "dtype": _dtype_name(tensor.dtype)})
        sections.append(section)
    raw = sections[0] if len(sections) == 1 else np.concatenate(sections) if sections else np.empty(0, np.uint8)
    return finished_body(spec, entries, raw, list(_split_body(raw, [section.nbytes for section in sections])), meta)


def empty_body(spec: CodecSpec, numels: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """A body for tensors of ``numels`` values: one buffer, and its section per tensor
    (the alignment padding zeroed, the rest to be written by quantizing)."""
    import numpy as np

    layouts = [spec.layout(numel) for numel in numels]
    raw = np.empty(sum(layout.total_bytes for layout in layouts), np.uint8)
    sections = list(_split_body(raw, [layout.total_bytes for layout in layouts]))
    for layout, section in zip(layouts, sections):
        section[layout.scale_bytes + layout.code_bytes :] = 0
    return raw, sections


def finished_body(
    spec: CodecSpec,
    entries: Sequence[Mapping[str, Any]],
    raw: np.ndarray,
    sections: Sequence[np.ndarray],
    meta: Mapping[str, Any] | None,
) -> PayloadBody:
    """The body of quantized ``sections`` (views of ``raw``) and its header: ``entries``
    hold each tensor's name, shape and dtype name, in body order."""
    document = {
        "codec": spec.header_fields(),
        "raw_body_bytes": raw.nbytes,
        "tensors": list(entries),
        "meta": dict(meta or {}),
    }
    header_json = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    header = PayloadHeader.model_validate_json(header_json)  # exactly what a receiver will read
    return PayloadBody(header, raw, tuple(sections), header_json)


def seal(body: PayloadBody, secret: RunSecret, *, compression_workers: int = 0) -> bytes:
    """The second half of :func:`encode_payload`: compress a quantized body with its
    codec's zstandard level and frame it with its tag.  With ``compression_workers``
    zstandard compresses on that many threads of its own; its bytes are then the same
    for any number of workers (but not those of none), and decode to the same body."""
    spec = body.header.codec
    # One-shot compression records the content size, which lets decoding allocate once.
    compressor = _compressor(spec.zstd_level, compression_workers)
    payload_body = compressor.compress(body.raw) if spec.zstd_level else body.raw
    header = body.header_json
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, secret.fingerprint, len(header), memoryview(payload_body).nbytes)
    tag = hashlib.blake2b(key=secret.key, digest_size=TAG_BYTES)
    for part in (prefix, header, payload_body):
        tag.update(part)
    return b"".join((prefix, header, payload_body, tag.digest()))


_ZSTD = threading.local()
"""Each thread's zstandard contexts, kept: making one costs about as much as compressing
a small fragment."""


def _compressor(level: int, workers: int) -> zstandard.ZstdCompressor:
    contexts = _ZSTD.__dict__.setdefault("compressors", {})
    if (level, workers) not in contexts:
        contexts[level, workers] = zstandard.ZstdCompressor(level=level, threads=workers)
    return contexts[level, workers]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_ZSTD, "decompressor"):
        _ZSTD.decompressor = zstandard.ZstdDecompressor()
    return _ZSTD.decompressor


def _split_body(raw: np.ndarray, sizes: Iterable[int]) -> Iterable[np.ndarray]:
    offset = 0
    for size in sizes:
        yield raw[offset : offset + size]
        offset += size


def _verified_parts(
    data: bytes | memoryview, secret: RunSecret, limits: PayloadLimits
) -> tuple[PayloadHeader, memoryview]:
    view = memoryview(data)
    if len(view) < PREFIX.size:
        if bytes(view[:4]) != MAGIC[: len(view)]:
            raise CorruptPayload("damaged or forged: it does not start like a diloco frame")
        raise TruncatedPayload(f"payload of {len(view)} bytes is shorter than its {PREFIX.size}-byte prefix")
    magic, version, flags, fingerprint, header_bytes, body_bytes = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPayload("damaged or forged: it does not start like a diloco frame")
    if header_bytes > limits.max_header_bytes or body_bytes > limits.max_body_bytes:
        raise PayloadTooLarge(
            f"frame declares a {header_bytes}-byte header and a {body_bytes}-byte body, beyond the limits "
            f"({limits.max_header_bytes} and {limits.max_body_bytes})"
        )
    expected = PREFIX.size + header_bytes + body_bytes + TAG_BYTES
    if len(view) < expected:
        raise TruncatedPayload(f"payload is {len(view)} bytes but its frame declares {expected}")
    if len(view) > expected:
        raise CorruptPayload(f"payload is {len(view)} bytes but its frame declares {expected}")
    # The tag first: until it verifies, no field of the frame is believed, so random or
    # altered bytes read as damaged or forged, never as some other format version.
    tagged = view[: expected - TAG_BYTES]
    digest = hashlib.blake2b(tagged, key=secret.key, digest_size=TAG_BYTES).digest()
    if not hmac.compare_digest(digest, bytes(view[expected - TAG_BYTES :])):
        if fingerprint != secret.fingerprint:
            raise WrongRun("the payload was written under another run's secret (or its prefix was damaged)")
        other = f" (or written by a diloco of format version {version})" if version != FORMAT_VERSION else ""
        raise CorruptPayload(f"tag mismatch: the payload was altered or forged{other}")
    if version != FORMAT_VERSION:
        raise UnsupportedFormat(
            f"payload format version {version}; this diloco reads version {FORMAT_VERSION} "
            "(run the same diloco version on every machine of a run)"
        )
    if flags != 0:
        raise UnsupportedFormat(f"unknown flags {flags:#x}: written by a newer diloco")
    header_start = PREFIX.size
    try:
        header = PayloadHeader.model_validate_json(bytes(view[header_start : header_start + header_bytes]))
    except ValidationError as error:
        raise CorruptPayload(f"authenticated header does not parse: {error}") from None
    return header, view[header_start + header_bytes : expected - TAG_BYTES]


def declared_values(data: bytes | memoryview) -> int:
    """How many tensor values a frame's header *declares*, without checking its tag: for
    counting what was written (metering) only, never for reading it.  0 for bytes that
    are not a whole frame."""
    view = memoryview(data)
    if len(view) < PREFIX.size:
        return 0
    magic, _version, _flags, _fingerprint, header_bytes, _body_bytes = PREFIX.unpack_from(view)
    if magic != MAGIC or PREFIX.size + header_bytes > len(view):
        return 0
    try:
        header = PayloadHeader.model_validate_json(bytes(view[PREFIX.size : PREFIX.size + header_bytes]))
    except ValidationError:
        return 0
    return sum(entry.numel for entry in header.tensors)


def read_header(data: bytes | memoryview, secret: RunSecret, limits: PayloadLimits = DEFAULT_LIMITS) -> PayloadHeader:
    """Verify a payload and return its header without decoding the tensors."""
    return _verified_parts(data, secret, limits)[0]


def decode_payload(
    data: bytes | memoryview,
    secret: RunSecret,
    limits: PayloadLimits = DEFAULT_LIMITS,
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    accumulate: bool = False,
) -> DecodedPayload:
    """Verify and decode a payload into fp32 CPU tensors.

    With ``into`` the values are written into (or, with ``accumulate``, added to) those
    tensors, which must be contiguous fp32 CPU tensors of the payload's names and shapes;
    the tag is verified before any of them is touched.
    """
    body = open_payload(data, secret, limits)
    targets = _decode_targets(body.header, into)
    body.decode_into(targets, accumulate=accumulate)
    return DecodedPayload(body.header, targets)


def open_payload(
    data: bytes | memoryview,
    secret: RunSecret,
    limits: PayloadLimits = DEFAULT_LIMITS,
    *,
    buffer: Callable[[int], np.ndarray] | None = None,
) -> PayloadBody:
    """Verify a payload and decompress its body, without decoding the values (what
    :func:`decode_payload` does first).  ``buffer(n)`` gives a uint8 buffer of n bytes
    for a compressed body, so that a caller opening payload after payload does not
    allocate each body afresh; the returned body is then a view of it."""
    header, body = _verified_parts(data, secret, limits)
    sizes = header.section_sizes()
    decoded_bytes = sum(4 * entry.numel for entry in header.tensors)
    if decoded_bytes > limits.max_decoded_bytes:
        raise PayloadTooLarge(f"payload decodes to {decoded_bytes} bytes, beyond {limits.max_decoded_bytes}")
    if sum(sizes) != header.raw_body_bytes:
        raise CorruptPayload("the header's tensor list does not match its body size")
    names = [entry.name for entry in header.tensors]
    if len(set(names)) != len(names):
        raise CorruptPayload("the payload names a tensor twice")
    raw = _decompressed_body(header, body, buffer)
    return PayloadBody(header, raw, tuple(_split_body(raw, sizes)))


def _decompressed_body(
    header: PayloadHeader, body: memoryview, buffer: Callable[[int], np.ndarray] | None = None
) -> np.ndarray:
    """The raw body, read-only: sections are only ever read from it."""
    import numpy as np

    if not header.codec.zstd_level:
        if len(body) != header.raw_body_bytes:
            raise CorruptPayload("uncompressed body size differs from the header")
        return np.frombuffer(body, dtype=np.uint8)
    try:
        parameters = zstandard.get_frame_parameters(body)
        if parameters.content_size != header.raw_body_bytes:
            raise CorruptPayload("the compressed body's size differs from the header")
        if buffer is not None:
            return _decompressed_into(body, buffer(header.raw_body_bytes))
        raw = _decompressor().decompress(body, max_output_size=header.raw_body_bytes)
    except zstandard.ZstdError as error:
        raise CorruptPayload(f"body does not decompress: {error}") from None
    except MemoryError:  # the output is allocated whole, at the size the header declares
        raise PayloadTooLarge(
            f"the body declares {header.raw_body_bytes} bytes, more than this machine can allocate"
        ) from None
    if len(raw) != header.raw_body_bytes:
        raise CorruptPayload("decompressed body size differs from the header")
    return np.frombuffer(raw, dtype=np.uint8)


def _decompressed_into(body: memoryview, out: np.ndarray) -> np.ndarray:
    """Decompress ``body`` into ``out``, which it must fill exactly."""
    reader = _decompressor().stream_reader(body, read_size=1 << 20)
    view, filled = memoryview(out), 0
    while filled < len(view):
        count = reader.readinto(view[filled:])
        if not count:
            raise CorruptPayload("decompressed body size differs from the header")
        filled += count
    return out


def _decode_targets(header: PayloadHeader, into: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    import torch

    if into is None:
        return {entry.name: torch.empty(entry.shape, dtype=torch.float32) for entry in header.tensors}
    targets = {}
    for entry in header.tensors:
        target = into.get(entry.name)
        if target is None:
            raise CorruptPayload(f"the payload holds tensor {entry.name!r}, which the receiver does not have")
        if tuple(target.shape) != entry.shape:
            raise CorruptPayload(
                f"tensor {entry.name!r} has shape {entry.shape} in the payload, {tuple(target.shape)} here"
            )
        if target.dtype != torch.float32 or target.device.type != "cpu" or not target.is_contiguous():
            raise ValueError(f"decoding into {entry.name!r} needs a contiguous fp32 CPU tensor")
        targets[entry.name] = target
    return targets
