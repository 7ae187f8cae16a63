"""The byte layout of a payload's body: codecs and the size of each tensor's section.

Pure arithmetic, without torch, so that what only reads headers (the CLI, status) starts
fast.  A section is ``[scales][codes]``: one bfloat16 scale per block for int8, int4 and
int2, none for the float formats, padded to 8 bytes so sections can be viewed as fp32 in
place.  A top-k section's codes are one record per block: the positions of its kept values
(a byte each) and their signs (a bit each).
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
    INT2 = "int2"
    TOPK = "topk"

    @property
    def levels(self) -> int:
        """The largest code (0 for the float formats).  int8 and int4 store the integers in
        ``[-levels, levels]`` with a block's scale its absmax over this; int2 the odd ones,
        -3, -1, 1 and 3, with the scale from the block's mean absolute value (clipping)."""
        return {Codec.INT8: 127, Codec.INT4: 7, Codec.INT2: 3}.get(self, 0)

    @property
    def values_per_byte(self) -> int:
        """Codes packed into one byte (1 for the formats of whole bytes per value)."""
        return {Codec.INT4: 2, Codec.INT2: 4}.get(self, 1)


MAX_TOPK_BLOCK = 256
"""A top-k block names each kept value by its position in one byte."""


def topk_record_bytes(keep_per_block: int) -> int:
    """A top-k block's codes: a position byte per kept value, then their sign bits."""
    return keep_per_block + -(-keep_per_block // 8)


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


def section_layout(codec: Codec, numel: int, block_size: int, keep_per_block: int = 0) -> SectionLayout:
    """The byte sizes of a tensor of ``numel`` values encoded with ``codec`` (top-k keeping
    ``keep_per_block`` values of each block)."""
    if codec is Codec.FP32:
        return SectionLayout(0, 4 * numel)
    if codec is Codec.BF16:
        return SectionLayout(0, 2 * numel)
    num_blocks = -(-numel // block_size)
    if codec is Codec.TOPK:
        return SectionLayout(2 * num_blocks, num_blocks * topk_record_bytes(keep_per_block))
    return SectionLayout(2 * num_blocks, -(-numel // codec.values_per_byte))
