"""fp32 and bf16: each value stored whole, fp32 as it is (passthrough) and bf16 rounded
to the nearest bfloat16; no scales, no blocks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from diloco_cli.codec.layout import SectionLayout

if TYPE_CHECKING:
    import numpy as np
    import torch

    from diloco_cli.codec.spec import CodecSpec


@dataclass(frozen=True)
class FloatCodec:
    """Values as floats of ``width`` bytes (4: fp32, 2: bfloat16)."""

    width: int
    fold_kind: int
    kernel: str | None = None
    kernel_constants: Mapping[str, float] = field(default_factory=dict)
    extra_parameters: tuple[str, ...] = ()
    offered_by_plan: bool = True

    def check(self, spec: CodecSpec) -> None:
        pass

    def layout(self, numel: int, spec: CodecSpec) -> SectionLayout:
        return SectionLayout(0, self.width * numel)

    def alignment(self, spec: CodecSpec) -> int:
        return 1

    def density(self, spec: CodecSpec) -> float:
        return 1.0

    def _dtype(self) -> torch.dtype:
        import torch

        return torch.float32 if self.width == 4 else torch.bfloat16

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

        from diloco_cli.codec.errors import NonFiniteValues

        stored = values.to(self._dtype())
        if not bool(torch.isfinite(stored).all()):
            raise NonFiniteValues("a tensor holds NaN or infinite values")
        torch.from_numpy(codes[: values.numel() * self.width]).copy_(stored.view(torch.uint8))
        if residual is not None:
            torch.sub(values, stored.to(torch.float32), out=residual)

    def decode(
        self, scales: np.ndarray, codes: np.ndarray, out: torch.Tensor, spec: CodecSpec, *, accumulate: bool
    ) -> None:
        import torch

        from diloco_cli.codec.blocks import as_tensor

        stored = as_tensor(codes[: out.numel() * self.width]).view(self._dtype())
        if accumulate:
            out.add_(stored.to(torch.float32))
        else:
            out.copy_(stored)


FP32 = FloatCodec(width=4, fold_kind=0)
BF16 = FloatCodec(width=2, fold_kind=1)
