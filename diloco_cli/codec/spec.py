"""How a payload is compressed: the codec, its block size and the zstandard level."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_cli.codec.layout import SectionLayout
from diloco_cli.codec.registry import Codec, codec_named

if TYPE_CHECKING:
    from diloco_cli.codec.registry import ValueCodec

MAX_BLOCK_SIZE = 4096
"""The merge kernels fold a block at a time through a buffer of this many values."""

OPTIONAL_PARAMETERS = ("keep_per_block",)
"""Fields a header names only for the codecs that read them (``extra_parameters``)."""


class CodecSpec(BaseModel):
    """The compression of one kind of payload (learner deltas or published updates)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    codec: Codec = Codec.INT4
    """Value format: fp32 (passthrough), bf16, int8 or int4 with a per-block absmax scale,
    or int2 (the four levels -3, -1, 1, 3 of a scale from the block's mean absolute value,
    larger values clipped), or topk (each block's ``keep_per_block`` values of largest
    magnitude, as their signs times the block's mean kept magnitude, the rest sent as 0);
    int2 and topk are for payloads sent with error feedback, which carries what they drop
    into the next send.  Any codec registered in :mod:`diloco_cli.codec.registry`."""

    block_size: int = Field(default=64, ge=2, le=MAX_BLOCK_SIZE)
    """Values per quantization block; each block stores one bfloat16 scale (int8, int4,
    int2 and topk only; topk at most 256, e.g. 256 keeping 8: 3%)."""

    keep_per_block: int = Field(default=8, ge=1)
    """topk only: values kept of each block (the rest wait in the error feedback)."""

    zstd_level: int = Field(default=1, ge=0, le=22)
    """zstandard level applied after quantization; 0 turns zstandard off."""

    @model_validator(mode="after")
    def _parameters_fit_codec(self) -> CodecSpec:
        self.implementation.check(self)
        return self

    @classmethod
    def unchecked(cls, codec: str, block_size: int, keep_per_block: int) -> CodecSpec:
        """A spec of these parameters, not validated: for the functions that take them one
        by one (:func:`~diloco_cli.codec.layout.section_layout`, the quantizers)."""
        return _unchecked(cls, str(codec), block_size, keep_per_block)

    @property
    def implementation(self) -> ValueCodec:
        """The codec's implementation, from the registry."""
        return codec_named(self.codec)

    def header_fields(self) -> dict[str, object]:
        """This spec as a payload's header names it: of :data:`OPTIONAL_PARAMETERS` only
        those its codec reads (``keep_per_block`` for topk), so that the other codecs'
        headers stay as they were."""
        fields = self.model_dump(mode="json")
        for name in OPTIONAL_PARAMETERS:
            if name not in self.implementation.extra_parameters:
                del fields[name]
        return fields

    def layout(self, numel: int) -> SectionLayout:
        """The byte sizes of a tensor of ``numel`` values in this format."""
        return self.implementation.layout(numel, self)

    @property
    def alignment(self) -> int:
        """Chunks of a tensor start at multiples of this many values (a block, or 1)."""
        return self.implementation.alignment(self)

    @property
    def density(self) -> float:
        """The share of a payload's values sent other than 0 (below 1 for top-k)."""
        return self.implementation.density(self)


@functools.cache
def _unchecked(cls: type[CodecSpec], codec: str, block_size: int, keep_per_block: int) -> CodecSpec:
    """Made once per parameters (a spec is frozen): the quantizers ask for one per tensor."""
    return cls.model_construct(codec=Codec(codec), block_size=block_size, keep_per_block=keep_per_block)
