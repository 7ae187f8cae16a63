"""The byte layout of a payload's body: codecs and the size of each tensor's section.

Pure arithmetic, without torch, so that what only reads headers (the CLI, status) starts
fast.  A section is ``[scales][codes]``: one bfloat16 scale per block for int8 and int4,
none for the float formats, padded to 8 bytes so sections can be viewed as fp32 in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MAX_INT4_BLOCK = 256
"""The int4 kernel unpacks a block into a stack buffer of this many values."""

SECTION_ALIGNMENT = 8


class Codec(str, Enum):
    """How each value is stored."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def levels(self) -> int:
        """Positive quantization levels (0 for the float formats)."""
        return {Codec.INT8: 127, Codec.INT4: 7}.get(self, 0)


@dataclass(frozen=True)
class SectionLayout:
    """Byte sizes of one tensor's section."""

    scale_bytes: int
    code_bytes: int

    @property
    def total_bytes(self) -> int:
        """The section's size, padded to :data:`SECTION_ALIGNMENT`."""
        raw = self.scale_bytes + self.code_bytes
        return -(-raw // SECTION_ALIGNMENT) * SECTION_ALIGNMENT


def section_layout(codec: Codec, numel: int, block_size: int) -> SectionLayout:
    """The byte sizes of a tensor of ``numel`` values encoded with ``codec``."""
    if codec is Codec.FP32:
        return SectionLayout(0, 4 * numel)
    if codec is Codec.BF16:
        return SectionLayout(0, 2 * numel)
    num_blocks = -(-numel // block_size)
    code_bytes = numel if codec is Codec.INT8 else -(-numel // 2)
    return SectionLayout(2 * num_blocks, code_bytes)
