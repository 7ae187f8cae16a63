"""Exact publication: every holder of the global weights adds the same decoded update.

The syncer's update ``U = Theta_new - Theta_now`` is quantized before it is published.
If the syncer applied U itself while learners applied ``decode(encode(U))`` they would
drift apart; instead everyone, the syncer included, applies the decoded update with
:func:`apply_update`, so all hold bit-identical global weights.  The quantization error
``U - decode(encode(U))`` is carried into the next update of the same fragment (error
feedback on the syncer side), so no part of an update is lost for good.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from diloco_cli.codec.frame import (
    PayloadBody,
    PayloadHeader,
    decode_payload,
    empty_body,
    finished_body,
    seal,
)
from diloco_cli.codec.quantize import dequantize_chunk, quantize_chunk
from diloco_cli.codec.secret import RunSecret
from diloco_cli.codec.spec import CodecSpec
from diloco_cli.core.types import FragmentIndex


class ExactPublisher:
    """Encodes global updates and keeps each fragment's carried quantization error."""

    def __init__(self, spec: CodecSpec, secret: RunSecret) -> None:
        self.spec = spec
        self._secret = secret
        self._carries: dict[FragmentIndex, dict[str, torch.Tensor]] = {}

    def encode_update(
        self, fragment: FragmentIndex, update: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None = None
    ) -> bytes:
        """The payload of ``update`` plus the fragment's carry; the new carry is kept."""
        encoder = self.update_encoder(fragment, {name: tuple(tensor.shape) for name, tensor in update.items()})
        for name, tensor in update.items():
            encoder.encode(name, 0, tensor.detach().to(torch.float32).reshape(-1))
        return self.seal(encoder.body(meta))

    def update_encoder(self, fragment: FragmentIndex, shapes: Mapping[str, tuple[int, ...]]) -> UpdateEncoder:
        """An encoder of the fragment's next update, chunk by chunk (for a caller that
        computes the update chunk by chunk, as the syncer's round does)."""
        carries = self._carries.setdefault(fragment, {})
        fresh = frozenset(name for name in shapes if name not in carries)
        for name in fresh:
            carries[name] = torch.empty(shapes[name])
        return UpdateEncoder(self.spec, {name: carries[name] for name in shapes}, fresh)

    def seal(self, body: PayloadBody, compression_workers: int = 0) -> bytes:
        """The second half of :meth:`encode_update`: the authenticated payload of ``body``
        (zstandard on ``compression_workers`` threads of its own, as :func:`seal`)."""
        return seal(body, self._secret, compression_workers=compression_workers)

    def carry_tensors(self) -> dict[str, torch.Tensor]:
        """The carried errors keyed ``"<fragment>/<tensor name>"`` (for persistence)."""
        return {
            f"{fragment}/{name}": carry
            for fragment, carries in sorted(self._carries.items())
            for name, carry in carries.items()
        }

    def load_carry_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._carries = {}
        for key, carry in tensors.items():
            fragment, _, name = key.partition("/")
            self._carries.setdefault(FragmentIndex(int(fragment)), {})[name] = carry.clone()


def apply_update(parameters: Mapping[str, torch.Tensor], payload: bytes, secret: RunSecret) -> PayloadHeader:
    """Add a published update to fp32 CPU parameters in place (verified first).

    The one function that both the syncer and every learner use, so that all of them
    compute ``Theta + decode(U)`` with the same fp32 operations (the syncer adds the
    update it quantized with these operations, :meth:`UpdateEncoder.add_decoded`,
    without reopening its payload).
    """
    return decode_payload(payload, secret, into=parameters, accumulate=True).header


class UpdateEncoder:
    """One update of a fragment, encoded a chunk at a time (``start`` a multiple of
    :attr:`block_size`): each chunk of ``U`` is added to its carry, and the carry
    quantized into the body, leaving the new quantization error in it.  Chunks may be
    encoded in any order and on any thread; the body is that of quantizing the whole
    update at once."""

    def __init__(self, spec: CodecSpec, carries: Mapping[str, torch.Tensor], fresh: frozenset[str]) -> None:
        self.spec = spec
        self.block_size = spec.alignment
        """Chunks start at multiples of this many values (the codec's block, or 1)."""
        self._carries = {name: carry.view(-1) for name, carry in carries.items()}
        self._fresh = fresh
        """Tensors without a carry yet: their first chunk is written, not added."""
        self._shapes = {name: tuple(carry.shape) for name, carry in carries.items()}
        self._raw, sections = empty_body(spec, [carry.numel() for carry in carries.values()])
        self._sections = dict(zip(carries, sections))

    def encode(self, name: str, start: int, update: torch.Tensor) -> None:
        """Quantize ``carry + U`` over ``[start, start + len(update))`` of tensor ``name``."""
        carry = self._carries[name][start : start + update.numel()]
        if name in self._fresh:
            carry.copy_(update)
        else:
            carry.add_(update)
        # encoding the carry in place overwrites it with the new quantization error
        quantize_chunk(
            self.spec.codec,
            carry,
            self.spec.block_size,
            self._sections[name],
            self._carries[name].numel(),
            start,
            carry,
            keep_per_block=self.spec.keep_per_block,
        )

    def add_decoded(self, name: str, start: int, parameters: torch.Tensor) -> None:
        """``parameters += decode(U)`` over the chunk at ``start`` of tensor ``name``, once
        it is encoded: :func:`apply_update`'s arithmetic on that chunk."""
        dequantize_chunk(
            self.spec.codec,
            self._sections[name],
            self._carries[name].numel(),
            self.spec.block_size,
            start,
            parameters,
            accumulate=True,
            keep_per_block=self.spec.keep_per_block,
        )

    def body(self, meta: Mapping[str, Any] | None = None) -> PayloadBody:
        """The quantized update, once every chunk is encoded."""
        entries = [{"name": name, "shape": list(shape), "dtype": "float32"} for name, shape in self._shapes.items()]
        return finished_body(self.spec, entries, self._raw, list(self._sections.values()), meta)


def fragment_digest(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> str:
    """BLAKE2b of a fragment's fp32 values in ``names`` order: equal digests mean the same
    weights bit for bit.  The syncer puts each fragment's digest in the head, and a
    learner checks what it installed against it."""
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        digest.update(tensors[name].detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
