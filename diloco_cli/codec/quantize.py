"""Block-wise absmax quantization of flat fp32 tensors into byte sections.

Every block of ``block_size`` values keeps one scale, ``absmax / levels`` rounded up to
a bfloat16 (2 bytes, exact in fp32), and each value becomes the nearest level
``round(x * (1 / scale))`` in ``[-levels, levels]`` (ties to even); decoding is
``q * scale`` rounded to fp32.  int8 uses 127 levels, int4
7 levels packed two to a byte (as in Streaming DiLoCo, arXiv 2501.18512, and Decoupled
DiLoCo, arXiv 2604.21428, whose ablation finds 4 bits lossless and 2 bits harmful).
int2 keeps four odd levels, ``q`` in {-3, -1, 1, 3}, the nearest odd integer to ``x /
scale`` with the scale from the block's mean absolute value (:data:`INT2_SCALE_OF_MEAN`),
so values beyond ``3 * scale`` are clipped; packed four to a byte.  It is meant for
learners' deltas, whose error feedback carries the rounding and the clipping into the next
send (as SparseLoCo, arXiv 2508.15706, does with 2-bit values).  top-k keeps the
``keep_per_block`` values of largest magnitude of each block (SparseLoCo's top-k of 1-3%
with error feedback), each as its position and its sign; the block's scale is the mean
magnitude of the kept values (they lie close together: 12% relative error on the kept
Gaussian values, keeping 8 of 256), and the other values decode to 0.

Two backends compute exactly the same bytes (top-k has the torch path only): fused C kernels
(``_kernels.c``, one pass per block, loaded with ctypes) and a torch reference used where
the kernels were not built (for int2 up to the order of a float64 sum, which changes a
block's scale only where the sum of its absolute values sits on a rounding boundary of
float64 after more than 2^29 of range between its values).  A section is
``[scales][codes]``, padded to 8 bytes so sections can be viewed as fp32 in place.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import warnings
from pathlib import Path

import numpy as np
import torch

from diloco_cli.codec.errors import CorruptPayload, NonFiniteValues
from diloco_cli.codec.layout import Codec, SectionLayout, section_layout, topk_record_bytes
from diloco_cli.codec.parallel import SERIAL, KernelPool

MAX_ABSMAX = 3.0e38
"""Beyond this a block's scale, rounded up to a bfloat16, would overflow (as in the kernels)."""

INT2_SCALE_OF_MEAN = 2.0 / 3.0
"""An int2 block's scale over its mean absolute value: levels at +-2/3 and +-2 of the mean,
a step of about one standard deviation of Gaussian values, near the best uniform 4-level
quantizer (Max, "Quantizing for minimum distortion", 1960: step 0.996 sigma); 34% relative
error on Gaussian values and 57% on Student-t(3) ones, where an absmax scale loses 51% and
123% (a block's largest value sets levels that most values are far from)."""


# ----------------------------------------------------------------------------- kernels


def _load_kernels(here: Path = Path(__file__).parent) -> ctypes.CDLL | None:
    """The kernels compiled in ``here``, or None (with a warning that says why)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_kernels{suffix}"
        if candidate.exists():
            try:
                library = ctypes.CDLL(str(candidate))
            except OSError as error:  # built for another platform: the torch path serves
                warnings.warn(
                    f"diloco's codec kernels {candidate} cannot be loaded ({error}); using the torch path",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return None
            try:
                _declare(library)
            except AttributeError as error:  # compiled from an older source: the torch path serves
                warnings.warn(
                    f"diloco's codec kernels {candidate} are out of date ({error}); using the torch path. "
                    "Rebuild them with: python -m diloco_cli.codec.build",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return None
            return library
    warnings.warn(
        "diloco's C codec kernels are not built (no C compiler at install time?); "
        "using the slower torch path. Reinstall with a compiler to get them.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _declare(library: ctypes.CDLL) -> None:
    """Declare the kernels' signatures; AttributeError when one is missing."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("diloco_quantize_int8", "diloco_quantize_int4", "diloco_quantize_int2"):
        function = getattr(library, name)
        function.argtypes = [pointer, size, size, pointer, pointer, pointer]
        function.restype = size
    for name in ("diloco_dequantize_int8", "diloco_dequantize_int4", "diloco_dequantize_int2"):
        function = getattr(library, name)
        function.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_int]
        function.restype = None
    library.diloco_fold_sumsq.argtypes = [ctypes.c_int, pointer, pointer, size, size, pointer]
    library.diloco_fold_sumsq.restype = ctypes.c_double
    weight = ctypes.c_float
    library.diloco_fold_sums.argtypes = [
        *(ctypes.c_int, pointer, pointer, size, size, pointer),
        *(pointer, weight, pointer, weight, ctypes.c_int),
    ]
    library.diloco_fold_sums.restype = ctypes.c_int


KERNELS = _load_kernels()
"""The compiled kernels, or None where the package was installed without them."""


def _address(array: np.ndarray | torch.Tensor | None) -> int | None:
    if array is None:
        return None
    if isinstance(array, torch.Tensor):
        return array.data_ptr()
    return array.ctypes.data


# ------------------------------------------------------------------------ quantization


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a numpy array that may be read-only (decoding only reads it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _split_section(section: np.ndarray, layout: SectionLayout) -> tuple[np.ndarray, np.ndarray]:
    scales = section[: layout.scale_bytes].view(np.int16)  # bfloat16 bit patterns
    codes = section[layout.scale_bytes : layout.scale_bytes + layout.code_bytes]
    return scales, codes


def quantize_into(
    codec: Codec,
    values: torch.Tensor,
    block_size: int,
    section: np.ndarray,
    residual: torch.Tensor | None = None,
    *,
    keep_per_block: int = 0,
    use_kernels: bool = True,
    pool: KernelPool = SERIAL,
) -> None:
    """Encode ``values`` (flat, contiguous, fp32, CPU) into ``section`` (uint8);
    ``keep_per_block`` is top-k's.

    When ``residual`` is given it receives ``values - decode(encoded)``, the error that
    error feedback carries into the next send.
    Raises :class:`NonFiniteValues` when a value is NaN or infinite.  The kernels run
    over ``pool``'s threads, a block-aligned chunk (:func:`quantize_chunk`) each, and
    write the same bytes whatever the thread count.
    """
    numel = values.numel()

    def chunk(start: int, length: int) -> NonFiniteValues | None:
        try:
            quantize_chunk(
                codec,
                values[start : start + length],
                block_size,
                section,
                numel,
                start,
                None if residual is None else residual[start : start + length],
                keep_per_block=keep_per_block,
                use_kernels=use_kernels,
            )
        except NonFiniteValues as error:  # raised below for the first chunk, whatever the threads
            return error
        return None

    if _uses_kernels(codec, use_kernels):
        errors = pool.map_chunks(chunk, numel, block_size)
    else:
        errors = [chunk(0, numel)]
    for error in errors:
        if error is not None:
            raise error


def quantize_chunk(
    codec: Codec,
    values: torch.Tensor,
    block_size: int,
    section: np.ndarray,
    numel: int,
    start: int,
    residual: torch.Tensor | None = None,
    *,
    keep_per_block: int = 0,
    use_kernels: bool = True,
) -> None:
    """Encode values ``[start, start + len(values))`` of a tensor of ``numel`` values into
    their place in the tensor's ``section``; ``start`` is a multiple of ``block_size``,
    so the chunk's blocks are the tensor's own and the bytes those of one call on the
    whole tensor.  ``residual`` is the chunk's residual (it may be ``values`` itself)."""
    scales, codes = _split_section(section, section_layout(codec, numel, block_size, keep_per_block))
    length = values.numel()
    first_block = start // block_size
    if codec is Codec.TOPK:
        record = topk_record_bytes(keep_per_block)
        blocks_codes = codes[first_block * record :]
        _topk_quantize(values, block_size, keep_per_block, scales[first_block:], blocks_codes, residual, first_block)
        return
    if codec in (Codec.FP32, Codec.BF16):
        stored = values if codec is Codec.FP32 else values.to(torch.bfloat16)
        if not bool(torch.isfinite(stored).all()):
            raise NonFiniteValues("a tensor holds NaN or infinite values")
        width = stored.element_size()
        torch.from_numpy(codes[start * width : (start + length) * width]).copy_(stored.view(torch.uint8))
        if residual is not None:
            torch.sub(values, stored.to(torch.float32), out=residual)
        return
    code_start = start // codec.values_per_byte
    if _uses_kernels(codec, use_kernels):
        function = getattr(KERNELS, f"diloco_quantize_{codec.value}")
        status = function(
            values.data_ptr(),
            length,
            block_size,
            _address(scales) + 2 * first_block,
            _address(codes) + code_start,
            _address(residual),
        )
        if status > 0:
            raise NonFiniteValues(f"block {first_block + status - 1} holds NaN or infinite values")
        if status < 0:
            raise ValueError(f"block_size {block_size} is not supported by the {codec.value} kernel")
        return
    _reference_quantize(codec, values, block_size, scales[first_block:], codes[code_start:], residual, first_block)


def _uses_kernels(codec: Codec, use_kernels: bool) -> bool:
    return KERNELS is not None and use_kernels and codec in (Codec.INT8, Codec.INT4, Codec.INT2)


def _checked_blocks(values: torch.Tensor, block_size: int, first_block: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def _store_scales(exact_scale: torch.Tensor, scales: np.ndarray) -> torch.Tensor:
    """Each block's scale rounded up to a bfloat16, written to ``scales`` (its top 16
    bits); returns the rounded scales (exact in fp32)."""
    rounded_up = (exact_scale.view(torch.int32) + 0xFFFF) & -65536
    torch.from_numpy(scales[: len(rounded_up)]).copy_((rounded_up >> 16).to(torch.int16))
    return rounded_up.view(torch.float32)


def _stored_scales(scales: np.ndarray, count: int) -> torch.Tensor:
    """The first ``count`` bfloat16 scales of a section, as fp32."""
    return (_as_tensor(scales[:count]).to(torch.int32) << 16).view(torch.float32)


def _reference_quantize(
    codec: Codec,
    values: torch.Tensor,
    block_size: int,
    scales: np.ndarray,
    codes: np.ndarray,
    residual: torch.Tensor | None,
    first_block: int = 0,
) -> None:
    """The torch quantizer; ``scales`` and ``codes`` start at the values' first block,
    number ``first_block`` of its tensor (for error messages)."""
    levels = float(codec.levels)
    numel = values.numel()
    blocks, absmax = _checked_blocks(values, block_size, first_block)
    if codec is Codec.INT2:
        counts = torch.full_like(absmax, block_size, dtype=torch.float64)
        counts[-1] = numel - (len(counts) - 1) * block_size
        # summed in float64, as the kernel does (exact for any order but in freak blocks)
        exact_scale = (blocks.abs().to(torch.float64).sum(dim=1) / counts * INT2_SCALE_OF_MEAN).to(torch.float32)
    else:
        exact_scale = absmax / levels
    block_scales = _store_scales(exact_scale, scales)
    inverse = torch.where(block_scales > 0, 1.0 / block_scales, torch.zeros_like(block_scales))
    scaled = blocks * inverse[:, None]
    if codec is Codec.INT2:  # the nearest odd integer
        quantized = (torch.round((scaled - 1) / 2) * 2 + 1).clamp_(-levels, levels)
    else:
        quantized = torch.round(scaled).clamp_(-levels, levels)
    flat = quantized.view(-1)[:numel].to(torch.int8)
    if codec is Codec.INT8:
        torch.from_numpy(codes[:numel]).copy_(flat.view(torch.uint8))
    else:
        _pack(codec, flat, codes)
    if residual is not None:
        decoded = (quantized * block_scales[:, None]).view(-1)[:numel]
        torch.sub(values, decoded, out=residual)


def _topk_quantize(
    values: torch.Tensor,
    block_size: int,
    keep: int,
    scales: np.ndarray,
    codes: np.ndarray,
    residual: torch.Tensor | None,
    first_block: int = 0,
) -> None:
    """top-k: each block's ``keep`` values of largest magnitude (ties to the lower
    position), their positions in ascending order and their sign bits, and the block's
    scale, the mean of their magnitudes (float64) rounded up to a bfloat16; ``scales`` and
    ``codes`` start at the values' first block."""
    numel = values.numel()
    blocks, _ = _checked_blocks(values, block_size, first_block)
    num_blocks = len(blocks)
    magnitudes = blocks.abs()
    # a stable sort by magnitude, largest first: equal magnitudes keep the lower position
    order = torch.sort(magnitudes, dim=1, descending=True, stable=True).indices[:, :keep]
    positions = torch.sort(order, dim=1).values
    kept = blocks.gather(1, positions)
    block_scales = _store_scales(kept.abs().to(torch.float64).mean(dim=1).to(torch.float32), scales)
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


def _topk_decoded(scales: np.ndarray, codes: np.ndarray, length: int, block_size: int, keep: int) -> torch.Tensor:
    """The first ``length`` values of top-k blocks (``scales`` and ``codes`` from their first)."""
    num_blocks = -(-length // block_size)
    record = topk_record_bytes(keep)
    records = _as_tensor(codes[: num_blocks * record]).view(num_blocks, record)
    positions = records[:, :keep].to(torch.int64)
    if bool((positions >= block_size).any()):
        raise CorruptPayload(f"a top-k position is beyond its block of {block_size} values")
    bits = (records[:, keep:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    negative = bits.reshape(num_blocks, -1)[:, :keep].bool()
    block_scales = _stored_scales(scales, num_blocks)[:, None]
    decoded = torch.zeros(num_blocks, block_size, dtype=torch.float32)
    decoded.scatter_(1, positions, torch.where(negative, -block_scales, block_scales))
    return decoded.view(-1)[:length]


def _pack(codec: Codec, levels: torch.Tensor, codes: np.ndarray) -> None:
    """Pack int4 or int2 levels into ``codes``, the first value in the lowest bits: int4
    as ``q + 8`` (0 pads an odd count, as code 8), int2 as ``(q + 3) / 2`` (padding 0)."""
    per_byte = codec.values_per_byte
    bits = 8 // per_byte
    fields = ((levels + 8) if codec is Codec.INT4 else (levels + 3) // 2).to(torch.uint8)
    padding = -len(fields) % per_byte
    if padding:
        pad = 8 if codec is Codec.INT4 else 0
        fields = torch.cat([fields, torch.full((padding,), pad, dtype=torch.uint8)])
    groups = fields.view(-1, per_byte)
    packed = groups[:, 0].clone()
    for slot in range(1, per_byte):
        packed |= groups[:, slot] << (bits * slot)
    torch.from_numpy(codes[: len(packed)]).copy_(packed)


def _unpack(codec: Codec, packed: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` levels (int8) of int4 or int2 codes packed by :func:`_pack`."""
    per_byte = codec.values_per_byte
    bits = 8 // per_byte
    mask = (1 << bits) - 1
    packed = packed[: -(-length // per_byte)]
    fields = torch.stack([(packed >> (bits * slot)) & mask for slot in range(per_byte)], dim=1).view(-1)[:length]
    fields = fields.to(torch.int8)
    return fields - 8 if codec is Codec.INT4 else fields * 2 - 3


def dequantize_into(
    codec: Codec,
    section: np.ndarray,
    numel: int,
    block_size: int,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    keep_per_block: int = 0,
    use_kernels: bool = True,
    pool: KernelPool = SERIAL,
) -> None:
    """Decode a section into ``out`` (flat, contiguous fp32, CPU): ``out = q*scale``, or
    ``out += q*scale`` with ``accumulate`` (the product rounded to fp32 first, so both
    forms agree bit for bit with decoding and adding separately).  The kernels run over
    ``pool``'s threads, a chunk (:func:`dequantize_chunk`) each."""

    def chunk(start: int, length: int) -> None:
        dequantize_chunk(
            codec,
            section,
            numel,
            block_size,
            start,
            out[start : start + length],
            accumulate=accumulate,
            keep_per_block=keep_per_block,
            use_kernels=use_kernels,
        )

    if _uses_kernels(codec, use_kernels):
        pool.map_chunks(chunk, numel, block_size)
    else:
        chunk(0, numel)


def dequantize_chunk(
    codec: Codec,
    section: np.ndarray,
    numel: int,
    block_size: int,
    start: int,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    keep_per_block: int = 0,
    use_kernels: bool = True,
) -> None:
    """Decode values ``[start, start + len(out))`` of a tensor of ``numel`` values from its
    section into ``out`` (``start`` a multiple of ``block_size``): the values, and the
    additions, of decoding the whole tensor."""
    scales, codes = _split_section(section, section_layout(codec, numel, block_size, keep_per_block))
    length = out.numel()
    first_block = start // block_size
    if codec is Codec.TOPK:
        record = topk_record_bytes(keep_per_block)
        decoded = _topk_decoded(scales[first_block:], codes[first_block * record :], length, block_size, keep_per_block)
        if accumulate:
            out.add_(decoded)
        else:
            out.copy_(decoded)
        return
    if codec in (Codec.FP32, Codec.BF16):
        stored = _as_tensor(codes).view(torch.float32 if codec is Codec.FP32 else torch.bfloat16)
        stored = stored[start : start + length]
        if accumulate:
            out.add_(stored.to(torch.float32))
        else:
            out.copy_(stored)
        return
    code_start = start // codec.values_per_byte
    if _uses_kernels(codec, use_kernels):
        function = getattr(KERNELS, f"diloco_dequantize_{codec.value}")
        function(
            _address(codes) + code_start,
            _address(scales) + 2 * first_block,
            length,
            block_size,
            out.data_ptr(),
            int(accumulate),
        )
        return
    codes_tensor = _as_tensor(codes[code_start:])
    if codec is Codec.INT8:
        levels = codes_tensor[:length].view(torch.int8).to(torch.float32)
    else:
        levels = _unpack(codec, codes_tensor, length).to(torch.float32)
    block_scales = _stored_scales(scales[first_block:], -(-length // block_size))
    block_scales = block_scales.repeat_interleave(block_size)[:length]
    decoded = levels * block_scales
    if accumulate:
        out.add_(decoded)
    else:
        out.copy_(decoded)
