"""topk: each block's ``keep_per_block`` values of largest magnitude, the rest sent as 0.

SparseLoCo's top-k of 1-3% with error feedback (arXiv 2508.15706): a block's codes are
one record, the positions of its kept values in ascending order (a byte each) and their
signs (a bit each); the block's scale is the mean magnitude of the kept values (float64,
rounded up to a bfloat16: they lie close together, 12% relative error on the kept
Gaussian values, keeping 8 of 256), and the other values decode to 0.  Torch path only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diloco_cli.codec.layout import SectionLayout

if TYPE_CHECKING:
    import numpy as np
    import torch

    from diloco_cli.codec.spec import CodecSpec

MAX_TOPK_BLOCK = 256
"""A top-k block names each kept value by its position in one byte."""


def topk_record_bytes(keep_per_block: int) -> int:
    """A top-k block's codes: a position byte per kept value, then their sign bits."""
    return keep_per_block + -(-keep_per_block // 8)


class TopkCodec:
    kernel = None
    fold_kind = None
    kernel_constants = {}
    extra_parameters = ("keep_per_block",)
    offered_by_plan = False

    def check(self, spec: CodecSpec) -> None:
        if spec.block_size > MAX_TOPK_BLOCK:
            raise ValueError(
                f"topk names a kept value by a byte: block_size must be at most {MAX_TOPK_BLOCK}, got {spec.block_size}"
            )
        if spec.keep_per_block >= spec.block_size:
            raise ValueError(
                f"topk keeps fewer values than a block holds: keep_per_block {spec.keep_per_block} must be below "
                f"block_size {spec.block_size}"
            )

    def layout(self, numel: int, spec: CodecSpec) -> SectionLayout:
        num_blocks = -(-numel // spec.block_size)
        return SectionLayout(2 * num_blocks, num_blocks * topk_record_bytes(spec.keep_per_block))

    def alignment(self, spec: CodecSpec) -> int:
        return spec.block_size

    def density(self, spec: CodecSpec) -> float:
        return spec.keep_per_block / spec.block_size

    def encode(
        self,
        values: torch.Tensor,
        scales: np.ndarray,
        codes: np.ndarray,
        residual: torch.Tensor | None,
        spec: CodecSpec,
        first_block: int,
    ) -> None:
        """Ties of magnitude keep the lower position."""
        import torch

        from diloco_cli.codec.blocks import checked_blocks, store_scales

        numel, keep = values.numel(), spec.keep_per_block
        blocks, _ = checked_blocks(values, spec.block_size, first_block)
        num_blocks = len(blocks)
        magnitudes = blocks.abs()
        # a stable sort by magnitude, largest first: equal magnitudes keep the lower position
        order = torch.sort(magnitudes, dim=1, descending=True, stable=True).indices[:, :keep]
        positions = torch.sort(order, dim=1).values
        kept = blocks.gather(1, positions)
        block_scales = store_scales(kept.abs().to(torch.float64).mean(dim=1).to(torch.float32), scales)
        negative = kept < 0
        record = topk_record_bytes(keep)
        records = torch.zeros(num_blocks, record, dtype=torch.uint8)
        records[:, :keep] = positions.to(torch.uint8)
        sign_bits = torch.zeros(num_blocks, 8 * (record - keep), dtype=torch.uint8)
        sign_bits[:, :keep] = negative.to(torch.uint8)
        weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
        records[:, keep:] = (sign_bits.view(num_blocks, -1, 8) * weights).sum(dim=2, dtype=torch.uint8)
        torch.from_numpy(codes[: num_blocks * record]).copy_(records.view(-1))
        if residual is not None:
            decoded = torch.zeros_like(blocks)
            decoded.scatter_(1, positions, torch.where(negative, -block_scales[:, None], block_scales[:, None]))
            torch.sub(values, decoded.view(-1)[:numel], out=residual)

    def decode(
        self, scales: np.ndarray, codes: np.ndarray, out: torch.Tensor, spec: CodecSpec, *, accumulate: bool
    ) -> None:
        import torch

        from diloco_cli.codec.blocks import as_tensor, stored_scales
        from diloco_cli.codec.errors import CorruptPayload

        length, block_size, keep = out.numel(), spec.block_size, spec.keep_per_block
        num_blocks = -(-length // block_size)
        record = topk_record_bytes(keep)
        records = as_tensor(codes[: num_blocks * record]).view(num_blocks, record)
        positions = records[:, :keep].to(torch.int64)
        if bool((positions >= block_size).any()):
            raise CorruptPayload(f"a top-k position is beyond its block of {block_size} values")
        bits = (records[:, keep:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        negative = bits.reshape(num_blocks, -1)[:, :keep].bool()
        block_scales = stored_scales(scales, num_blocks)[:, None]
        decoded = torch.zeros(num_blocks, block_size, dtype=torch.float32)
        decoded.scatter_(1, positions, torch.where(negative, -block_scales, block_scales))
        decoded = decoded.view(-1)[:length]
        if accumulate:
            out.add_(decoded)
        else:
            out.copy_(decoded)


TOPK = TopkCodec()
