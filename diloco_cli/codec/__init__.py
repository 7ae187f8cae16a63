"""The payload codec: block-wise quantization, zstandard, and an authenticated frame.

Everything that crosses a bucket as tensors goes through :func:`encode_payload` and
:func:`decode_payload`.  Nothing is ever unpickled.  The codecs (how values are stored)
are registered by name (:mod:`diloco_cli.codec.registry`, :func:`register_codec`).
"""

from diloco_cli.codec.errors import (
    CorruptPayload,
    NonFiniteValues,
    PayloadError,
    PayloadTooLarge,
    TruncatedPayload,
    UnsupportedFormat,
    WrongRun,
)
from diloco_cli.codec.registry import Codec, register_codec
from diloco_cli.codec.secret import RunSecret

_LAZY = {
    "CodecSpec": "diloco_cli.codec.spec",
    "DecodedPayload": "diloco_cli.codec.frame",
    "decode_payload": "diloco_cli.codec.frame",
    "encode_payload": "diloco_cli.codec.frame",
    "read_header": "diloco_cli.codec.frame",
    "declared_values": "diloco_cli.codec.frame",
}
"""Imported on first use (numpy, zstandard, pydantic), so that what only needs the
errors or the secret (``diloco runs``, ``logs``) starts fast."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'diloco_cli.codec' has no attribute {name!r}")


__all__ = [
    "Codec",
    "CodecSpec",
    "CorruptPayload",
    "DecodedPayload",
    "NonFiniteValues",
    "PayloadError",
    "PayloadTooLarge",
    "RunSecret",
    "TruncatedPayload",
    "UnsupportedFormat",
    "WrongRun",
    "decode_payload",
    "encode_payload",
    "read_header",
    "declared_values",
    "register_codec",
]
