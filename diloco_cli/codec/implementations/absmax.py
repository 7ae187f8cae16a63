"""int8 and int4: block-wise absmax quantization.

Every block of ``block_size`` values keeps one scale, ``absmax / levels`` rounded up to a
bfloat16, and each value becomes the nearest level ``round(x * (1 / scale))`` in
``[-levels, levels]`` (ties to even); decoding is ``q * scale`` rounded to fp32.  int8
uses 127 levels, one byte a value; int4 7 levels packed two to a byte as ``q + 8``, the
first value in the low nibble (as in Streaming DiLoCo, arXiv 2501.18512, and Decoupled
DiLoCo, arXiv 2604.21428, whose ablation finds 4 bits lossless and 2 bits harmful).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diloco_cli.codec.layout import SectionLayout

if TYPE_CHECKING:
    import numpy as np
    import torch

    from diloco_cli.codec.spec import CodecSpec

MAX_INT4_BLOCK = 256
"""The int4 kernel unpacks a block into a stack buffer of this many values."""

INT4_PADDING = 8
"""The code of a missing value after an odd count (the level 0)."""


@dataclass(frozen=True)
class AbsmaxCodec:
    """Levels in ``[-levels, levels]`` of a block's absmax scale, ``values_per_byte`` codes a byte."""

    name: str
    levels: int
    values_per_byte: int
    kernel: str
    fold_kind: int
    kernel_constants: Mapping[str, float]
    max_block: int | None = None
    extra_parameters: tuple[str, ...] = ()
    offered_by_plan: bool = True

    def check(self, spec: CodecSpec) -> None:
        if self.max_block is not None and (spec.block_size % self.values_per_byte or spec.block_size > self.max_block):
            raise ValueError(f"{self.name} needs an even block_size of at most {self.max_block}, got {spec.block_size}")

    def layout(self, numel: int, spec: CodecSpec) -> SectionLayout:
        return SectionLayout(2 * -(-numel // spec.block_size), -(-numel // self.values_per_byte))

    def alignment(self, spec: CodecSpec) -> int:
        return spec.block_size

    def density(self, spec: CodecSpec) -> float:
        return 1.0

    def encode(
        self,
        values: torch.Tensor,
        scales: np.ndarray,
        codes: np.ndarray,
        residual: torch.Tensor | None,
        spec: CodecSpec,
        first_block: int,
    ) -> None:
        import torch

        from diloco_cli.codec.blocks import checked_blocks, pack, scaled_blocks, store_scales, write_residual

        blocks, absmax = checked_blocks(values, spec.block_size, first_block)
        levels = float(self.levels)
        block_scales = store_scales(absmax / levels, scales)
        quantized = torch.round(scaled_blocks(blocks, block_scales)).clamp_(-levels, levels)
        flat = quantized.view(-1)[: values.numel()].to(torch.int8)
        if self.values_per_byte == 1:
            torch.from_numpy(codes[: values.numel()]).copy_(flat.view(torch.uint8))
        else:
            pack((flat + INT4_PADDING).to(torch.uint8), self.values_per_byte, INT4_PADDING, codes)
        write_residual(values, quantized, block_scales, residual)

    def decode(
        self, scales: np.ndarray, codes: np.ndarray, out: torch.Tensor, spec: CodecSpec, *, accumulate: bool
    ) -> None:
        import torch

        from diloco_cli.codec.blocks import as_tensor, decode_levels, unpack

        if self.values_per_byte == 1:
            levels = as_tensor(codes)[: out.numel()].view(torch.int8)
        else:
            levels = unpack(codes, self.values_per_byte, out.numel()) - INT4_PADDING
        decode_levels(levels, scales, spec.block_size, out, accumulate=accumulate)


INT8 = AbsmaxCodec(
    name="int8", levels=127, values_per_byte=1, kernel="int8", fold_kind=2, kernel_constants={"INT8_LEVELS": 127}
)
INT4 = AbsmaxCodec(
    name="int4",
    levels=7,
    values_per_byte=2,
    kernel="int4",
    fold_kind=3,
    kernel_constants={"INT4_LEVELS": 7, "INT4_MAX_BLOCK": MAX_INT4_BLOCK},
    max_block=MAX_INT4_BLOCK,
)
