"""The run secret: the key of every payload's BLAKE2b tag.

It travels only to the machines of the run (never to a bucket, a log or a status view);
its ``repr`` hides the bytes so an accidental print leaks nothing.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field

SECRET_BYTES = 32
"""Length of a run secret; BLAKE2b accepts keys of up to 64 bytes."""


@dataclass(frozen=True)
class RunSecret:
    """A run's key for payload tags."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not 16 <= len(self.key) <= 64:
            raise ValueError(f"a run secret must be 16 to 64 bytes long, got {len(self.key)}")

    @classmethod
    def generate(cls) -> RunSecret:
        """A fresh random secret for a new run."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> RunSecret:
        """Parse the form written by :meth:`to_hex` (the secret file's content)."""
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError as error:
            raise ValueError(f"a run secret file must hold hex digits: {error}") from None

    def to_hex(self) -> str:
        return self.key.hex()

    @property
    def fingerprint(self) -> bytes:
        """8 bytes that identify the run without revealing the key (stored in frames)."""
        return hashlib.blake2b(b"diloco run fingerprint", key=self.key, digest_size=8).digest()

    def __str__(self) -> str:
        return f"RunSecret(fingerprint={self.fingerprint.hex()})"
