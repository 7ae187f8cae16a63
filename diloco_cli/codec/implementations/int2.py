"""int2: four odd levels of a scale from the block's mean absolute value.

Each value becomes ``q`` in {-3, -1, 1, 3}, the nearest odd integer to ``x / scale``, with
the block's scale :data:`SCALE_OF_MEAN` times its mean absolute value (summed in float64)
rounded up to a bfloat16, so values beyond ``3 * scale`` are clipped; codes ``(q + 3) / 2``
packed four to a byte, the first value in the lowest bits (a tail short of four padded
with code 0).  It is meant for learners' deltas, whose error feedback carries the rounding
and the clipping into the next send (as SparseLoCo, arXiv 2508.15706, does with 2-bit
values).  The torch path equals the kernel up to the order of a float64 sum, which changes
a block's scale only where the sum of its absolute values sits on a rounding boundary of
float64 after more than 2^29 of range between its values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco_cli.codec.layout import SectionLayout

if TYPE_CHECKING:
    import numpy as np
    import torch

    from diloco_cli.codec.spec import CodecSpec

SCALE_OF_MEAN = 2.0 / 3.0
"""A block's scale over its mean absolute value: levels at +-2/3 and +-2 of the mean,
a step of about one standard deviation of Gaussian values, near the best uniform 4-level
quantizer (Max, "Quantizing for minimum distortion", 1960: step 0.996 sigma); 34% relative
error on Gaussian values and 57% on Student-t(3) ones, where an absmax scale loses 51% and
123% (a block's largest value sets levels that most values are far from)."""

LEVELS = 3
VALUES_PER_BYTE = 4


class Int2Codec:
    kernel = "int2"
    fold_kind = 4
    kernel_constants = {"INT2_LEVELS": LEVELS, "INT2_SCALE_OF_MEAN": SCALE_OF_MEAN}
    extra_parameters = ()
    offered_by_plan = False

    def check(self, spec: CodecSpec) -> None:
        if spec.block_size % VALUES_PER_BYTE:
            raise ValueError(f"int2 packs four codes a byte: block_size must be a multiple of 4, got {spec.block_size}")

    def layout(self, numel: int, spec: CodecSpec) -> SectionLayout:
        return SectionLayout(2 * -(-numel // spec.block_size), -(-numel // VALUES_PER_BYTE))

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

        numel, block_size, levels = values.numel(), spec.block_size, float(LEVELS)
        blocks, absmax = checked_blocks(values, block_size, first_block)
        counts = torch.full_like(absmax, block_size, dtype=torch.float64)
        counts[-1] = numel - (len(counts) - 1) * block_size
        # summed in float64, as the kernel does (exact for any order but in freak blocks)
        exact_scale = (blocks.abs().to(torch.float64).sum(dim=1) / counts * SCALE_OF_MEAN).to(torch.float32)
        block_scales = store_scales(exact_scale, scales)
        scaled = scaled_blocks(blocks, block_scales)
        quantized = (torch.round((scaled - 1) / 2) * 2 + 1).clamp_(-levels, levels)  # the nearest odd integer
        flat = quantized.view(-1)[:numel].to(torch.int8)
        pack(((flat + LEVELS) // 2).to(torch.uint8), VALUES_PER_BYTE, 0, codes)
        write_residual(values, quantized, block_scales, residual)

    def decode(
        self, scales: np.ndarray, codes: np.ndarray, out: torch.Tensor, spec: CodecSpec, *, accumulate: bool
    ) -> None:
        from diloco_cli.codec.blocks import decode_levels, unpack

        levels = unpack(codes, VALUES_PER_BYTE, out.numel()) * 2 - LEVELS
        decode_levels(levels, scales, spec.block_size, out, accumulate=accumulate)


INT2 = Int2Codec()
