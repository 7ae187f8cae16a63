"""What the block codecs' torch paths share: blocks checked for finite values, bfloat16
scales rounded up, bit fields packed into bytes, and levels times their scales.

A block codec keeps one scale per block of ``block_size`` values, rounded up to a
bfloat16 (2 bytes, exact in fp32) and stored as its bit pattern; decoding is ``level *
scale`` rounded to fp32, exactly as the C kernels compute it.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from diloco_cli.codec.errors import NonFiniteValues

MAX_ABSMAX = 3.0e38
"""Beyond this a block's scale, rounded up to a bfloat16, would overflow (as in the kernels)."""


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array that may be read-only (decoding only reads it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def checked_blocks(values: torch.Tensor, block_size: int, first_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` padded with zeros to whole blocks, one block a row, and each block's
    absolute maximum; :class:`NonFiniteValues` names the first block (of its tensor:
    ``first_block`` is the values' first) with NaN, infinity or a scale that would overflow."""
    numel = values.numel()
    padded = torch.zeros(-(-numel // block_size) * block_size, dtype=torch.float32)
    padded[:numel] = values
    blocks = padded.view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    invalid = ~(absmax <= MAX_ABSMAX)
    if bool(invalid.any()):
        raise NonFiniteValues(f"block {first_block + int(invalid.nonzero()[0])} holds NaN or infinite values")
    return blocks, absmax


def store_scales(exact_scale: torch.Tensor, scales: np.ndarray) -> torch.Tensor:
    """Each block's scale rounded up to a bfloat16, written to ``scales`` (its top 16
    bits); returns the rounded scales (exact in fp32)."""
    rounded_up = (exact_scale.view(torch.int32) + 0xFFFF) & -65536
    torch.from_numpy(scales[: len(rounded_up)]).copy_((rounded_up >> 16).to(torch.int16))
    return rounded_up.view(torch.float32)


def stored_scales(scales: np.ndarray, count: int) -> torch.Tensor:
    """The first ``count`` bfloat16 scales of a section, as fp32."""
    return (as_tensor(scales[:count]).to(torch.int32) << 16).view(torch.float32)


def scaled_blocks(blocks: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """Each block times the inverse of its scale (0 for a block of zeros)."""
    inverse = torch.where(block_scales > 0, 1.0 / block_scales, torch.zeros_like(block_scales))
    return blocks * inverse[:, None]


def write_residual(
    values: torch.Tensor, levels: torch.Tensor, block_scales: torch.Tensor, residual: torch.Tensor | None
) -> None:
    """``residual = values - levels * scale`` (``levels`` one block a row, padded)."""
    if residual is not None:
        decoded = (levels * block_scales[:, None]).view(-1)[: values.numel()]
        torch.sub(values, decoded, out=residual)


def pack(fields: torch.Tensor, per_byte: int, padding: int, codes: np.ndarray) -> None:
    """Pack ``fields`` (uint8, each below ``2 ** (8 // per_byte)``) ``per_byte`` to a byte
    into ``codes``, the first in the lowest bits; a last byte short of fields is filled
    with ``padding``."""
    bits = 8 // per_byte
    missing = -len(fields) % per_byte
    if missing:
        fields = torch.cat([fields, torch.full((missing,), padding, dtype=torch.uint8)])
    groups = fields.view(-1, per_byte)
    packed = groups[:, 0].clone()
    for slot in range(1, per_byte):
        packed |= groups[:, slot] << (bits * slot)
    torch.from_numpy(codes[: len(packed)]).copy_(packed)


def unpack(codes: np.ndarray, per_byte: int, length: int) -> torch.Tensor:
    """The first ``length`` fields (int8) packed by :func:`pack` into ``codes``."""
    bits = 8 // per_byte
    mask = (1 << bits) - 1
    packed = as_tensor(codes)[: -(-length // per_byte)]
    fields = torch.stack([(packed >> (bits * slot)) & mask for slot in range(per_byte)], dim=1).view(-1)[:length]
    return fields.to(torch.int8)


def decode_levels(
    levels: torch.Tensor, scales: np.ndarray, block_size: int, out: torch.Tensor, *, accumulate: bool
) -> None:
    """``out = levels * scale`` (or ``+=``) for the blocks of ``scales``, each product
    rounded to fp32 before it is added."""
    length = out.numel()
    block_scales = stored_scales(scales, -(-length // block_size)).repeat_interleave(block_size)[:length]
    decoded = levels.to(torch.float32) * block_scales
    if accumulate:
        out.add_(decoded)
    else:
        out.copy_(decoded)
