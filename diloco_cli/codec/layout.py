"""The byte layout of a payload's body: the size of each tensor's section.

Pure arithmetic, without torch, so that what only reads headers (the CLI, status) starts
fast.  A section is ``[scales][codes]``, padded to 8 bytes so sections can be viewed as
fp32 in place; how many scales and codes a tensor takes is its codec's
(:meth:`~diloco_cli.codec.registry.ValueCodec.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_cli.codec.registry import codec_named

SECTION_ALIGNMENT = 8


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


def section_layout(codec: str, numel: int, block_size: int, keep_per_block: int = 0) -> SectionLayout:
    """The byte sizes of a tensor of ``numel`` values encoded with ``codec`` (top-k keeping
    ``keep_per_block`` values of each block)."""
    from diloco_cli.codec.spec import CodecSpec  # which imports this module

    spec = CodecSpec.unchecked(codec, block_size, keep_per_block)
    return codec_named(codec).layout(numel, spec)
