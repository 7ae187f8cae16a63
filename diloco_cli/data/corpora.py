"""The corpora that ship with the package, checked by hash, and the data sources' error.

Kept apart from the batching in :mod:`~diloco_cli.data.text` so that ``diloco up`` can
check a recipe's ``data.source`` without importing torch.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

import zstandard

BUILTIN_PREFIX = "builtin:"
BUILTIN_CORPORA = {
    "shakespeare": ("shakespeare.txt.zst", "04decea0dd965df5e6cfc4a538b0c62623aaa3bfd848ac7fad6734e59c96624d"),
}


class DataError(ValueError):
    """The data source cannot be used as asked."""


@functools.cache
def builtin_corpus(name: str) -> bytes:
    """The decompressed built-in corpus ``name``, verified against its SHA-256."""
    if name not in BUILTIN_CORPORA:
        raise DataError(f"unknown built-in corpus {name!r}; available: {', '.join(sorted(BUILTIN_CORPORA))}")
    filename, digest = BUILTIN_CORPORA[name]
    compressed = resources.files("diloco_cli.data").joinpath(filename).read_bytes()
    text = zstandard.ZstdDecompressor().decompress(compressed)
    if hashlib.sha256(text).hexdigest() != digest:
        raise DataError(f"the built-in corpus {name!r} is damaged (hash mismatch); reinstall diloco")
    return text
