"""Codecs by name: the protocol each one implements, and the registry that finds them.

A codec is one module (the built-in ones in ``codec/implementations/``) holding an object
of the :class:`ValueCodec` protocol: its section's layout, its encoding and decoding,
its number among the merge kernels' formats and what a plan needs of it.  It is
registered here by name, as fsspec registers its filesystems: :data:`known_codecs` maps a
name to ``"module:attribute"``, imported on first use (so that what only reads headers
imports no codec's tensor code), and :func:`register_codec` adds one at run time.  The
frame, the merge's fold, exact publication and the traffic plan ask the registry and
branch on no codec.

Adding a codec is its module and a line in :data:`known_codecs`; where it wants speed,
C kernels in ``_kernels.c`` of the standard signatures (:attr:`ValueCodec.kernel`), and
a ``KIND_`` of the merge kernels (:attr:`ValueCodec.fold_kind`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from diloco_cli.codec.layout import SectionLayout
    from diloco_cli.codec.spec import CodecSpec

known_codecs: dict[str, ValueCodec | str] = {
    "fp32": "diloco_cli.codec.implementations.floats:FP32",
    "bf16": "diloco_cli.codec.implementations.floats:BF16",
    "int8": "diloco_cli.codec.implementations.absmax:INT8",
    "int4": "diloco_cli.codec.implementations.absmax:INT4",
    "int2": "diloco_cli.codec.implementations.int2:INT2",
    "topk": "diloco_cli.codec.implementations.topk:TOPK",
}
"""Every codec by its name (a recipe's ``codec`` and a payload header's): an
implementation, or where to import it from (``"module:attribute"``)."""


class ValueCodec(Protocol):
    """How one codec stores a flat fp32 tensor in its section of a payload's body.

    A section is ``[scales][codes]`` (:class:`~diloco_cli.codec.layout.SectionLayout`):
    the scales are bfloat16 bit patterns, one per block (none for a format without
    blocks), the codes bytes whose meaning is the codec's.  Encoding and decoding work on
    chunks of a tensor that start at a multiple of :meth:`alignment` values, so that a
    chunk's bytes are those of its place in the whole tensor's section.
    """

    kernel: str | None
    """The name of its C kernels in ``_kernels.c``, ``diloco_quantize_<kernel>`` and
    ``diloco_dequantize_<kernel>`` (the signatures of int8's), which compute exactly the
    bytes of :meth:`encode` and :meth:`decode`; None: its torch path serves alone."""

    fold_kind: int | None
    """Its number among the formats of the merge kernels (``KIND_<NAME>`` of
    ``_kernels.c``), which fold a payload of it into a merge's sums without decoding it
    into a tensor; None: such payloads are decoded with :meth:`decode` and folded."""

    kernel_constants: Mapping[str, float]
    """The constants of ``_kernels.c`` its Python side also states, by their C names
    (``tests/unit/test_kernel_constants.py`` checks them against the C source)."""

    extra_parameters: tuple[str, ...]
    """The fields of :class:`~diloco_cli.codec.spec.CodecSpec` it reads beyond ``codec``,
    ``block_size`` and ``zstd_level`` (which every header names): its headers name them."""

    offered_by_plan: bool
    """Whether ``diloco plan`` weighs it for uploads and updates alike: False for a codec
    that drops so much that only error feedback makes it train well (int2, top-k),
    which a traffic plan cannot judge."""

    def check(self, spec: CodecSpec) -> None:
        """Raise ValueError (its message for a person) if ``spec``'s parameters do not fit."""

    def layout(self, numel: int, spec: CodecSpec) -> SectionLayout:
        """The byte sizes of the section of ``numel`` values; for a chunk's start
        (a multiple of :meth:`alignment`) the offsets of its scales and codes."""

    def alignment(self, spec: CodecSpec) -> int:
        """Chunks of a tensor start at multiples of this many values: its block, or 1."""

    def density(self, spec: CodecSpec) -> float:
        """The share of a payload's values it sends other than 0 (1 but for sparse codecs):
        how a plan sizes the update merged from such payloads."""

    def encode(
        self,
        values: torch.Tensor,
        scales: np.ndarray,
        codes: np.ndarray,
        residual: torch.Tensor | None,
        spec: CodecSpec,
        first_block: int,
    ) -> None:
        """Encode ``values`` (a chunk: flat, contiguous fp32, CPU) into ``scales`` (int16)
        and ``codes`` (uint8), which start at the chunk's first; ``residual``, when given,
        receives ``values - decode(encoded)`` (it may be ``values`` itself).  Raises
        :class:`~diloco_cli.codec.errors.NonFiniteValues` naming the first bad block of
        the tensor (the chunk's first is ``first_block``)."""

    def decode(
        self,
        scales: np.ndarray,
        codes: np.ndarray,
        out: torch.Tensor,
        spec: CodecSpec,
        *,
        accumulate: bool,
    ) -> None:
        """Decode the chunk of ``len(out)`` values that ``scales`` and ``codes`` start at
        into ``out`` (``out += decoded`` with ``accumulate``, the decoded values rounded to
        fp32 first); raises :class:`~diloco_cli.codec.errors.CorruptPayload` for codes
        that cannot have been encoded."""


def codec_named(name: str) -> ValueCodec:
    """The codec registered as ``name`` (imported on first use); ValueError if none is."""
    try:
        entry = known_codecs[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}: the codecs are {_spelled(known_codecs)}") from None
    return _imported(entry) if isinstance(entry, str) else entry


def register_codec(name: str, implementation: ValueCodec | str) -> None:
    """Make ``implementation`` (or ``"module:attribute"``, imported on first use) the
    codec of ``name``, for recipes and payload headers; a name is registered once."""
    if name in known_codecs:
        raise ValueError(f"a codec named {name!r} is already registered")
    known_codecs[name] = implementation


@functools.cache
def _imported(path: str) -> ValueCodec:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _spelled(names: Iterable[str]) -> str:
    """``'a', 'b' or 'c'``, as pydantic spells an enum's choices."""
    quoted = [repr(str(name)) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class _RegisteredNames(type):
    """Iterating :class:`Codec` gives the registered codecs' names, in registration order."""

    def __iter__(cls) -> Iterator[Codec]:
        return iter([cls(name) for name in known_codecs])

    def __len__(cls) -> int:
        return len(known_codecs)


class Codec(str, metaclass=_RegisteredNames):
    """A registered codec's name, as recipes and payload headers spell it (``"int4"``).

    One object per name, so that names compare with ``is`` as the enum this type replaces
    did; ``Codec("int3")`` is refused while no codec of that name is registered.  A
    recipe's or a header's codec is validated into one (an unknown name is a validation
    error that lists the codecs).
    """

    FP32: ClassVar[Codec]
    BF16: ClassVar[Codec]
    INT8: ClassVar[Codec]
    INT4: ClassVar[Codec]
    INT2: ClassVar[Codec]
    TOPK: ClassVar[Codec]

    _interned: ClassVar[dict[str, Codec]] = {}

    def __new__(cls, name: str) -> Codec:
        plain = str.__str__(name)
        if plain not in known_codecs:
            raise ValueError(f"unknown codec {plain!r}: the codecs are {_spelled(known_codecs)}")
        if plain not in cls._interned:
            cls._interned[plain] = super().__new__(cls, plain)
        return cls._interned[plain]

    @property
    def value(self) -> str:
        """The name as a plain ``str`` (as the enum this type replaces spelled it)."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return f"Codec({self.value!r})"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import PydanticCustomError, core_schema

        def validated(name: str) -> Codec:
            if name not in known_codecs:  # worded as pydantic words an enum's refusal
                raise PydanticCustomError("enum", "Input should be {expected}", {"expected": _spelled(known_codecs)})
            return cls(name)

        return core_schema.no_info_after_validator_function(
            validated, core_schema.str_schema(), serialization=core_schema.to_string_ser_schema()
        )


Codec.FP32, Codec.BF16, Codec.INT8, Codec.INT4, Codec.INT2, Codec.TOPK = (
    Codec(name) for name in ("fp32", "bf16", "int8", "int4", "int2", "topk")
)
