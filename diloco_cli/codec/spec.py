"""How a payload is compressed: the codec, its block size and the zstandard level."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_cli.codec.layout import MAX_INT4_BLOCK, MAX_TOPK_BLOCK, Codec, SectionLayout, section_layout


class CodecSpec(BaseModel):
    """The compression of one kind of payload (learner deltas or published updates)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    codec: Codec = Codec.INT4
    """Value format: fp32 (passthrough), bf16, int8 or int4 with a per-block absmax scale,
    or int2 (the four levels -3, -1, 1, 3 of a scale from the block's mean absolute value,
    larger values clipped), or topk (each block's ``keep_per_block`` values of largest
    magnitude, as their signs times the block's mean kept magnitude, the rest sent as 0);
    int2 and topk are for payloads sent with error feedback, which carries what they drop
    into the next send."""

    block_size: int = Field(default=64, ge=2, le=4096)
    """Values per quantization block; each block stores one bfloat16 scale (int8, int4,
    int2 and topk only; topk at most 256, e.g. 256 keeping 8: 3%)."""

    keep_per_block: int = Field(default=8, ge=1)
    """topk only: values kept of each block (the rest wait in the error feedback)."""

    zstd_level: int = Field(default=1, ge=0, le=22)
    """zstandard level applied after quantization; 0 turns zstandard off."""

    @model_validator(mode="after")
    def _block_fits_codec(self) -> CodecSpec:
        if self.codec is Codec.INT4 and (self.block_size % 2 or self.block_size > MAX_INT4_BLOCK):
            raise ValueError(f"int4 needs an even block_size of at most {MAX_INT4_BLOCK}, got {self.block_size}")
        if self.codec is Codec.INT2 and self.block_size % 4:
            raise ValueError(f"int2 packs four codes a byte: block_size must be a multiple of 4, got {self.block_size}")
        if self.codec is Codec.TOPK and self.block_size > MAX_TOPK_BLOCK:
            raise ValueError(
                f"topk names a kept value by a byte: block_size must be at most {MAX_TOPK_BLOCK}, got {self.block_size}"
            )
        if self.codec is Codec.TOPK and self.keep_per_block >= self.block_size:
            raise ValueError(
                f"topk keeps fewer values than a block holds: keep_per_block {self.keep_per_block} must be below "
                f"block_size {self.block_size}"
            )
        return self

    def header_fields(self) -> dict[str, object]:
        """This spec as a payload's header names it (``keep_per_block`` only for topk, so
        that the other codecs' headers stay as they were)."""
        fields = self.model_dump(mode="json")
        if self.codec is not Codec.TOPK:
            del fields["keep_per_block"]
        return fields

    def layout(self, numel: int) -> SectionLayout:
        """The byte sizes of a tensor of ``numel`` values in this format."""
        return section_layout(self.codec, numel, self.block_size, self.keep_per_block)
