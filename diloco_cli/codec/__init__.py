"""The payload codec: block-wise quantization, zstandard, and an authenticated frame.

Everything that crosses a bucket as tensors goes through :func:`encode_payload` and
:func:`decode_payload`.  Nothing is ever unpickled.
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
from diloco_cli.codec.frame import DecodedPayload, decode_payload, encode_payload, read_header
from diloco_cli.codec.layout import Codec
from diloco_cli.codec.secret import RunSecret
from diloco_cli.codec.spec import CodecSpec

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
]
