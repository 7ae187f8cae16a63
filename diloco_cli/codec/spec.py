"""How a payload is compressed: the codec, its block size and the zstandard level."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_cli.codec.layout import MAX_INT4_BLOCK, Codec


class CodecSpec(BaseModel):
    """The compression of one kind of payload (learner deltas or published updates)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    codec: Codec = Codec.INT4
    """Value format: fp32 (passthrough), bf16, int8 or int4 with a per-block absmax scale,
    or int2 (the four levels -3, -1, 1, 3 of a scale from the block's mean absolute value,
    larger values clipped: for deltas sent with error feedback)."""

    block_size: int = Field(default=64, ge=2, le=4096)
    """Values per quantization block; each block stores one bfloat16 scale (int8, int4 and
    int2 only)."""

    zstd_level: int = Field(default=1, ge=0, le=22)
    """zstandard level applied after quantization; 0 turns zstandard off."""

    @model_validator(mode="after")
    def _block_fits_codec(self) -> CodecSpec:
        if self.codec is Codec.INT4 and (self.block_size % 2 or self.block_size > MAX_INT4_BLOCK):
            raise ValueError(f"int4 needs an even block_size of at most {MAX_INT4_BLOCK}, got {self.block_size}")
        if self.codec is Codec.INT2 and self.block_size % 4:
            raise ValueError(f"int2 packs four codes a byte: block_size must be a multiple of 4, got {self.block_size}")
        return self
