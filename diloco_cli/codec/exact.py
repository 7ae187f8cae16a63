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

from diloco_cli.codec.frame import PayloadHeader, decode_payload, encode_payload
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
        carries = self._carries.setdefault(fragment, {})
        for name, tensor in update.items():
            carry = carries.get(name)
            if carry is None:
                carries[name] = tensor.detach().to(torch.float32).clone()
            else:
                carry.add_(tensor)
        # The carry now holds U + previous carry; encoding it in place overwrites it with
        # the new quantization error (the codec allows a residual to alias its input).
        targets = [(name, carries[name]) for name in update]
        return encode_payload(targets, self.spec, self._secret, meta, residuals_into=carries)

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
    compute ``Theta + decode(U)`` with the same fp32 operations.
    """
    return decode_payload(payload, secret, into=parameters, accumulate=True).header


def fragment_digest(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> str:
    """BLAKE2b of a fragment's fp32 values in ``names`` order: equal digests mean the same
    weights bit for bit.  The syncer puts each fragment's digest in the head, and a
    learner checks what it installed against it."""
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        digest.update(tensors[name].detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
