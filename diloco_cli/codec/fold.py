"""A verified payload folded straight into a merge's running sums.

A merge anchors each learner's payload on the drift since its base and folds it into the
running sums of :class:`~diloco_cli.core.merge.MergeAccumulator`: ``D = drift +
decode(payload)``, ``|D|``, ``sum += w D`` and ``unit_sum += (w / |D|) D``.  With tensors
that is a copy of the drift, a decode onto it, a norm and two adds: five passes over
fragment-sized memory per arrival, and a fragment-sized scratch.  :class:`AnchoredPayload`
makes two passes that write nothing but the sums (``_kernels.c``): one decodes each block
of the payload onto the drift and squares it into the norm (float64), the other decodes
it again and adds it, times each weight, into both sums.  Both run over fixed chunks on a
:class:`~diloco_cli.codec.parallel.KernelPool`'s threads; the norm's partial sums are
added in chunk order, so the result is the same for any number of threads.

Where the kernels were not built the same is computed with torch ops: the same sums up to
the rounding of the norm (summed in another order).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from diloco_cli.codec.frame import PayloadBody, TensorEntry
from diloco_cli.codec.parallel import SERIAL, KernelPool
from diloco_cli.codec.quantize import KERNELS, dequantize_into
from diloco_cli.codec.registry import Codec, codec_named


class AnchoredPayload:
    """One learner's anchored outer gradients ``D = drift + decode(body)``, read by
    :meth:`~diloco_cli.core.merge.MergeAccumulator.add` tensor by tensor.

    ``drift`` is None for a payload sent from the newest version (no drift); else it
    holds a contiguous fp32 tensor per name.  ``body`` must hold exactly ``names``.
    """

    def __init__(
        self,
        body: PayloadBody,
        drift: Mapping[str, torch.Tensor] | None,
        pool: KernelPool = SERIAL,
        *,
        use_kernels: bool = True,
    ) -> None:
        self.body, self.drift, self.pool = body, drift, pool
        self.names = [entry.name for entry in body.header.tensors]
        self._kind = body.header.codec.implementation.fold_kind
        """The codec's number among the merge kernels' formats (None: the torch path)."""
        self._use_kernels = use_kernels and KERNELS is not None and self._kind is not None
        self._anchored: tuple[str, torch.Tensor] | None = None
        """The torch path's last anchored tensor, so that norm and fold decode it once."""

    def norm(self, name: str) -> float:
        """``|D|`` of tensor ``name``."""
        if not self._use_kernels:
            return float(torch.linalg.vector_norm(self._anchored_tensor(name), dtype=torch.float64))
        entry, codes, scales, block = self._section(name)
        drift = self._drift_address(name)
        spec, kind = self.body.header.codec, self._kind

        def sum_of_squares(start: int, length: int) -> float:
            offsets = spec.layout(start)
            return KERNELS.diloco_fold_sumsq(
                kind,
                codes + offsets.code_bytes,
                scales + offsets.scale_bytes,
                length,
                block,
                None if drift is None else drift + 4 * start,
            )

        total = 0.0
        for partial in self.pool.map_chunks(sum_of_squares, entry.numel, block):
            if partial < 0:
                raise ValueError(f"block_size {block} is beyond the merge kernels' tile")
            total += partial  # in chunk order, whatever the thread count
        return math.sqrt(total)

    def fold(
        self,
        name: str,
        weighted_sum: torch.Tensor | None,
        weight: float,
        unit_sum: torch.Tensor | None = None,
        unit_weight: float = 0.0,
        *,
        overwrite_weighted: bool = False,
        overwrite_unit: bool = False,
    ) -> None:
        """``weighted_sum += weight * D`` and ``unit_sum += unit_weight * D`` for tensor
        ``name`` (``=`` instead of ``+=`` where overwrite says so: the sum's first write),
        each product rounded to fp32 before it is added."""
        if not self._use_kernels:
            anchored = self._anchored_tensor(name)
            for total, factor, overwrite in (
                (weighted_sum, weight, overwrite_weighted),
                (unit_sum, unit_weight, overwrite_unit),
            ):
                if total is None:
                    continue
                if overwrite:
                    torch.mul(anchored, factor, out=total.view(-1))
                else:
                    total.view(-1).add_(torch.mul(anchored, factor))
            self._anchored = None
            return
        entry, codes, scales, block = self._section(name)
        drift = self._drift_address(name)
        spec, kind = self.body.header.codec, self._kind
        weighted = None if weighted_sum is None else _address_of(weighted_sum, entry)
        unit = None if unit_sum is None else _address_of(unit_sum, entry)
        overwrite = int(overwrite_weighted) | 2 * int(overwrite_unit)

        def fold_chunk(start: int, length: int) -> int:
            offsets = spec.layout(start)
            return KERNELS.diloco_fold_sums(
                kind,
                codes + offsets.code_bytes,
                scales + offsets.scale_bytes,
                length,
                block,
                None if drift is None else drift + 4 * start,
                None if weighted is None else weighted + 4 * start,
                weight,
                None if unit is None else unit + 4 * start,
                unit_weight,
                overwrite,
            )

        if any(status < 0 for status in self.pool.map_chunks(fold_chunk, entry.numel, block)):
            raise ValueError(f"block_size {block} is beyond the merge kernels' tile")

    # ---------------------------------------------------------------------- helpers

    def _section(self, name: str) -> tuple[TensorEntry, int, int, int]:
        """The entry, the addresses of the codes and the scales, and the block size (1 for
        a format without blocks: its chunks may start anywhere)."""
        entry, section = self.body.section(name)
        spec = self.body.header.codec
        layout = spec.layout(entry.numel)
        address = section.ctypes.data
        return entry, address + layout.scale_bytes, address, spec.alignment

    def _drift_address(self, name: str) -> int | None:
        if self.drift is None:
            return None
        entry, _ = self.body.section(name)
        return _address_of(self.drift[name], entry)

    def _anchored_tensor(self, name: str) -> torch.Tensor:
        """The torch path: ``D`` of tensor ``name`` decoded into a tensor of its own."""
        if self._anchored is not None and self._anchored[0] == name:
            return self._anchored[1]
        entry, section = self.body.section(name)
        spec = self.body.header.codec
        anchored = torch.empty(entry.numel)
        dequantize_into(
            spec.codec,
            section,
            entry.numel,
            spec.block_size,
            anchored,
            keep_per_block=spec.keep_per_block,
            use_kernels=False,
        )
        if self.drift is not None:
            anchored = torch.add(self.drift[name].view(-1), anchored)
        self._anchored = (name, anchored)
        return anchored


def norm(tensor: torch.Tensor, pool: KernelPool = SERIAL, *, use_kernels: bool = True) -> float:
    """The L2 norm of a contiguous fp32 CPU tensor, summed in float64 by the same kernel
    and chunks as :meth:`AnchoredPayload.norm`: the same for any number of threads."""
    if not (use_kernels and KERNELS is not None):
        return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("the kernels' norm needs a contiguous fp32 CPU tensor")
    address = tensor.data_ptr()
    kind = codec_named(Codec.FP32).fold_kind
    partials = pool.map_chunks(
        lambda start, length: KERNELS.diloco_fold_sumsq(kind, address + 4 * start, None, length, 1, None),
        tensor.numel(),
    )
    total = 0.0
    for partial in partials:
        total += partial
    return math.sqrt(total)


def _address_of(tensor: torch.Tensor, entry: TensorEntry) -> int:
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"folding into {entry.name!r} needs a contiguous fp32 CPU tensor")
    if tensor.numel() != entry.numel:
        raise ValueError(f"tensor {entry.name!r} has {tensor.numel()} values here, {entry.numel} in the payload")
    return tensor.data_ptr()
