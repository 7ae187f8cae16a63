"""Encoding and decoding a tensor's section, chunk by chunk, with any registered codec.

Each codec (:mod:`diloco_cli.codec.registry`) holds its own arithmetic; this module runs
it over a tensor: it finds a chunk's place in the section (its codec's layout of the
values before it), and calls the codec's C kernels where they were built (fused, one
pass per block, loaded with ctypes: ``_kernels.c``) over a
:class:`~diloco_cli.codec.parallel.KernelPool`'s threads, else its torch path, which
computes the same bytes.  A section is ``[scales][codes]``, padded to 8 bytes so
sections can be viewed as fp32 in place.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import warnings
from pathlib import Path

import numpy as np
import torch

from diloco_cli.codec.blocks import MAX_ABSMAX
from diloco_cli.codec.errors import NonFiniteValues
from diloco_cli.codec.parallel import SERIAL, KernelPool
from diloco_cli.codec.registry import Codec, ValueCodec, codec_named
from diloco_cli.codec.spec import MAX_BLOCK_SIZE, CodecSpec

# ----------------------------------------------------------------------------- kernels

KERNEL_CONSTANTS = {"MAX_ABSMAX": MAX_ABSMAX, "MAX_TILE": MAX_BLOCK_SIZE}
"""The constants of ``_kernels.c`` that every codec shares, by their C names (each codec
states its own in its ``kernel_constants``; ``tests/unit/test_kernel_constants.py``
checks both against the C source)."""

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64

_CODEC_KERNELS = {
    "quantize": ([_POINTER, _SIZE, _SIZE, _POINTER, _POINTER, _POINTER], _SIZE),
    "dequantize": ([_POINTER, _POINTER, _SIZE, _SIZE, _POINTER, ctypes.c_int], None),
}
"""The signatures every codec's kernels share: ``diloco_quantize_<kernel>(values, n,
block, scales, codes, residual)`` returns 0, the 1-based index of the first block with a
non-finite value, or -1 for a block size it cannot take; ``diloco_dequantize_<kernel>(codes,
scales, n, block, out, accumulate)``."""


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
    """Declare the kernels' signatures (every registered codec's, and the merge's);
    AttributeError when one is missing."""
    for codec in Codec:
        kernel = codec_named(codec).kernel
        if kernel is not None:
            for operation in _CODEC_KERNELS:
                _codec_kernel(library, operation, kernel)
    pointer, size = _POINTER, _SIZE
    library.diloco_fold_sumsq.argtypes = [ctypes.c_int, pointer, pointer, size, size, pointer]
    library.diloco_fold_sumsq.restype = ctypes.c_double
    weight = ctypes.c_float
    library.diloco_fold_sums.argtypes = [
        *(ctypes.c_int, pointer, pointer, size, size, pointer),
        *(pointer, weight, pointer, weight, ctypes.c_int),
    ]
    library.diloco_fold_sums.restype = ctypes.c_int


@functools.cache
def _codec_kernel(library: ctypes.CDLL, operation: str, kernel: str):
    """``diloco_<operation>_<kernel>`` of ``library``, declared (once)."""
    function = getattr(library, f"diloco_{operation}_{kernel}")
    function.argtypes, function.restype = _CODEC_KERNELS[operation]
    return function


KERNELS = _load_kernels()
"""The compiled kernels, or None where the package was installed without them."""


def _address(array: np.ndarray | torch.Tensor | None) -> int | None:
    if array is None:
        return None
    if isinstance(array, torch.Tensor):
        return array.data_ptr()
    return array.ctypes.data


def _kernel_of(implementation: ValueCodec, use_kernels: bool) -> str | None:
    """The name of the codec's kernels where they run, else None (its torch path)."""
    if KERNELS is None or not use_kernels:
        return None
    return implementation.kernel


def _chunk_parts(spec: CodecSpec, section: np.ndarray, numel: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """The scales (int16) and the codes (uint8) of a tensor of ``numel`` values in its
    ``section``, from those of the chunk at value ``start`` (a multiple of its alignment)."""
    whole, before = spec.layout(numel), spec.layout(start)
    scales = section[before.scale_bytes : whole.scale_bytes].view(np.int16)  # bfloat16 bit patterns
    codes = section[whole.scale_bytes + before.code_bytes : whole.scale_bytes + whole.code_bytes]
    return scales, codes


# ----------------------------------------------------------------------------- encoding


def quantize_into(
    codec: str,
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
    over ``pool``'s threads, a chunk (:func:`quantize_chunk`) each, and write the same
    bytes whatever the thread count.
    """
    numel = values.numel()
    spec = CodecSpec.unchecked(codec, block_size, keep_per_block)

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

    if _kernel_of(spec.implementation, use_kernels):
        errors = pool.map_chunks(chunk, numel, spec.alignment)
    else:
        errors = [chunk(0, numel)]
    for error in errors:
        if error is not None:
            raise error


def quantize_chunk(
    codec: str,
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
    their place in the tensor's ``section``; ``start`` is a multiple of the codec's
    alignment (its block), so the chunk's blocks are the tensor's own and the bytes those
    of one call on the whole tensor.  ``residual`` is the chunk's residual (it may be
    ``values`` itself)."""
    spec = CodecSpec.unchecked(codec, block_size, keep_per_block)
    implementation = spec.implementation
    scales, codes = _chunk_parts(spec, section, numel, start)
    first_block = start // block_size
    kernel = _kernel_of(implementation, use_kernels)
    if kernel is None:
        implementation.encode(values, scales, codes, residual, spec, first_block)
        return
    status = _codec_kernel(KERNELS, "quantize", kernel)(
        values.data_ptr(), values.numel(), block_size, _address(scales), _address(codes), _address(residual)
    )
    if status > 0:
        raise NonFiniteValues(f"block {first_block + status - 1} holds NaN or infinite values")
    if status < 0:
        raise ValueError(f"block_size {block_size} is not supported by the {kernel} kernel")


# ----------------------------------------------------------------------------- decoding


def dequantize_into(
    codec: str,
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
    spec = CodecSpec.unchecked(codec, block_size, keep_per_block)

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

    if _kernel_of(spec.implementation, use_kernels):
        pool.map_chunks(chunk, numel, spec.alignment)
    else:
        chunk(0, numel)


def dequantize_chunk(
    codec: str,
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
    section into ``out`` (``start`` a multiple of the codec's alignment): the values, and
    the additions, of decoding the whole tensor."""
    spec = CodecSpec.unchecked(codec, block_size, keep_per_block)
    implementation = spec.implementation
    scales, codes = _chunk_parts(spec, section, numel, start)
    kernel = _kernel_of(implementation, use_kernels)
    if kernel is None:
        implementation.decode(scales, codes, out, spec, accumulate=accumulate)
        return
    _codec_kernel(KERNELS, "dequantize", kernel)(
        _address(codes), _address(scales), out.numel(), block_size, out.data_ptr(), int(accumulate)
    )
