"""Block-wise absmax quantization of flat fp32 tensors into byte sections.

Every block of ``block_size`` values keeps one scale, ``absmax / levels`` rounded up to
a bfloat16 (2 bytes, exact in fp32), and each value becomes the nearest level
``round(x * (1 / scale))`` in ``[-levels, levels]`` (ties to even); decoding is
``q * scale`` rounded to fp32.  int8 uses 127 levels, int4
7 levels packed two to a byte (as in Streaming DiLoCo, arXiv 2501.18512, and Decoupled
DiLoCo, arXiv 2604.21428, whose ablation finds 4 bits lossless and 2 bits harmful).

Two backends compute exactly the same bytes: fused C kernels (``_kernels.c``, one pass
per block, loaded with ctypes) and a torch reference used where the kernels were not
built.  A section is ``[scales][codes]``, padded to 8 bytes so sections can be viewed as
fp32 in place.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import warnings
from pathlib import Path

import numpy as np
import torch

from diloco_cli.codec.errors import NonFiniteValues
from diloco_cli.codec.layout import Codec, SectionLayout, section_layout

MAX_ABSMAX = 3.0e38
"""Beyond this a block's scale, rounded up to a bfloat16, would overflow (as in the kernels)."""


# ----------------------------------------------------------------------------- kernels


def _load_kernels() -> ctypes.CDLL | None:
    here = Path(__file__).parent
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
            pointer, size = ctypes.c_void_p, ctypes.c_int64
            for name in ("diloco_quantize_int8", "diloco_quantize_int4"):
                function = getattr(library, name)
                function.argtypes = [pointer, size, size, pointer, pointer, pointer]
                function.restype = size
            for name in ("diloco_dequantize_int8", "diloco_dequantize_int4"):
                function = getattr(library, name)
                function.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_int]
                function.restype = None
            return library
    warnings.warn(
        "diloco's C codec kernels are not built (no C compiler at install time?); "
        "using the slower torch path. Reinstall with a compiler to get them.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


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
    use_kernels: bool = True,
) -> None:
    """Encode ``values`` (flat, contiguous, fp32, CPU) into ``section`` (uint8).

    When ``residual`` is given it receives ``values - decode(encoded)``, the error that
    error feedback carries into the next send.
    Raises :class:`NonFiniteValues` when a value is NaN or infinite.
    """
    layout = section_layout(codec, values.numel(), block_size)
    scales, codes = _split_section(section, layout)
    if codec in (Codec.FP32, Codec.BF16):
        stored = values if codec is Codec.FP32 else values.to(torch.bfloat16)
        if not bool(torch.isfinite(stored).all()):
            raise NonFiniteValues("a tensor holds NaN or infinite values")
        torch.from_numpy(codes).copy_(stored.view(torch.uint8))
        if residual is not None:
            torch.sub(values, stored.to(torch.float32), out=residual)
        return
    if KERNELS is not None and use_kernels:
        function = KERNELS.diloco_quantize_int8 if codec is Codec.INT8 else KERNELS.diloco_quantize_int4
        status = function(
            values.data_ptr(), values.numel(), block_size, _address(scales), _address(codes), _address(residual)
        )
        if status > 0:
            raise NonFiniteValues(f"block {status - 1} holds NaN or infinite values")
        if status < 0:
            raise ValueError(f"block_size {block_size} is not supported by the {codec.value} kernel")
        return
    _reference_quantize(codec, values, block_size, scales, codes, residual)


def _reference_quantize(
    codec: Codec,
    values: torch.Tensor,
    block_size: int,
    scales: np.ndarray,
    codes: np.ndarray,
    residual: torch.Tensor | None,
) -> None:
    levels = float(codec.levels)
    numel = values.numel()
    padded = torch.zeros(-(-numel // block_size) * block_size, dtype=torch.float32)
    padded[:numel] = values
    blocks = padded.view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    invalid = ~(absmax <= MAX_ABSMAX)  # NaN, infinity, or a scale that would overflow
    if bool(invalid.any()):
        raise NonFiniteValues(f"block {int(invalid.nonzero()[0])} holds NaN or infinite values")
    rounded_up = ((absmax / levels).view(torch.int32) + 0xFFFF) & -65536
    block_scales = rounded_up.view(torch.float32)
    inverse = torch.where(block_scales > 0, 1.0 / block_scales, torch.zeros_like(block_scales))
    quantized = torch.round(blocks * inverse[:, None]).clamp_(-levels, levels)
    torch.from_numpy(scales).copy_((rounded_up >> 16).to(torch.int16))
    flat = quantized.view(-1)[:numel].to(torch.int8)
    if codec is Codec.INT8:
        torch.from_numpy(codes).copy_(flat.view(torch.uint8))
    else:
        nibbles = (flat + 8).to(torch.uint8)
        if numel % 2:
            nibbles = torch.cat([nibbles, torch.tensor([8], dtype=torch.uint8)])
        pairs = nibbles.view(-1, 2)
        torch.from_numpy(codes).copy_(pairs[:, 0] | (pairs[:, 1] << 4))
    if residual is not None:
        decoded = (quantized * block_scales[:, None]).view(-1)[:numel]
        torch.sub(values, decoded, out=residual)


def dequantize_into(
    codec: Codec,
    section: np.ndarray,
    numel: int,
    block_size: int,
    out: torch.Tensor,
    *,
    accumulate: bool = False,
    use_kernels: bool = True,
) -> None:
    """Decode a section into ``out`` (flat, contiguous fp32, CPU): ``out = q*scale``, or
    ``out += q*scale`` with ``accumulate`` (the product rounded to fp32 first, so both
    forms agree bit for bit with decoding and adding separately)."""
    layout = section_layout(codec, numel, block_size)
    scales, codes = _split_section(section, layout)
    if codec in (Codec.FP32, Codec.BF16):
        stored = _as_tensor(codes).view(torch.float32 if codec is Codec.FP32 else torch.bfloat16)
        if accumulate:
            out.add_(stored.to(torch.float32))
        else:
            out.copy_(stored)
        return
    if KERNELS is not None and use_kernels:
        function = KERNELS.diloco_dequantize_int8 if codec is Codec.INT8 else KERNELS.diloco_dequantize_int4
        function(_address(codes), _address(scales), numel, block_size, out.data_ptr(), int(accumulate))
        return
    codes_tensor = _as_tensor(codes)
    if codec is Codec.INT8:
        levels = codes_tensor.view(torch.int8).to(torch.float32)
    else:
        unpacked = torch.stack([codes_tensor & 15, codes_tensor >> 4], dim=1).view(-1)[:numel]
        levels = unpacked.to(torch.float32) - 8
    block_scales = (_as_tensor(scales).to(torch.int32) << 16).view(torch.float32)
    block_scales = block_scales.repeat_interleave(block_size)[:numel]
    decoded = levels * block_scales
    if accumulate:
        out.add_(decoded)
    else:
        out.copy_(decoded)
