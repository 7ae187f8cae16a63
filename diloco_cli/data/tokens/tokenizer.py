"""The tokenizer of a dataset: a Hugging Face ``tokenizers`` file, given or trained here.

Without a tokenizer of yours, ``diloco prepare`` trains a byte-level BPE (GPT-2's
scheme: every byte is a token to start from, so any text encodes and decodes back
exactly) with an end-of-document token, on the first :data:`TRAINING_SAMPLE_BYTES` of
the corpus.  A tokenizer is identified by the SHA-256 of its ``tokenizer.json``: shards
are only meaningful with the exact tokenizer that made them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from diloco_cli.data.tokens.index import DatasetError

EOS_TOKEN = "<|endoftext|>"
"""The end-of-document token a trained tokenizer gets (GPT-2's)."""

BYTE_TOKENS = 256
"""A byte-level BPE starts from one token per byte."""

TRAINING_SAMPLE_BYTES = 256 << 20
"""A trained BPE learns its merges from this much text at the corpus's start."""


@dataclass(frozen=True)
class DatasetTokenizer:
    """A tokenizer with the bytes of its ``tokenizer.json``."""

    tokenizer: Any
    """The ``tokenizers.Tokenizer``."""
    content: bytes
    """Its ``tokenizer.json``, exactly as stored beside the shards."""
    eos_token_id: int
    """The token written after every document."""

    @classmethod
    def from_json(cls, content: bytes, source: str, eos_token: str) -> DatasetTokenizer:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_str(content.decode())
        except Exception as error:  # tokenizers raises a bare Exception for any bad file
            raise DatasetError(
                f"{source} is not a Hugging Face tokenizer.json ({error}); "
                "give the tokenizer.json of a `tokenizers` tokenizer"
            ) from None
        eos_token_id = tokenizer.token_to_id(eos_token)
        if eos_token_id is None:
            raise DatasetError(
                f"tokenizer {source} has no token {eos_token!r}; "
                "name its end-of-document token with --eos-token (e.g. '</s>')"
            )
        return cls(tokenizer, content, eos_token_id)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, documents: list[str]) -> list[list[int]]:
        """Each document's token ids (no special tokens added: the EOS is the caller's)."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(documents, add_special_tokens=False)]


def load_tokenizer(url: str, storage_options: dict[str, Any], eos_token: str) -> DatasetTokenizer:
    """The ``tokenizer.json`` at ``url`` (a local path or an fsspec URL)."""
    try:
        with fsspec.open(url, "rb", **storage_options) as handle:
            content = handle.read()
    except FileNotFoundError:
        raise DatasetError(
            f"tokenizer {url} does not exist; give the path of a tokenizer.json, or --vocab-size N to train one"
        ) from None
    return DatasetTokenizer.from_json(content, url, eos_token)


def sample_of(documents: Iterable[str], limit_bytes: int) -> Iterator[str]:
    """The documents at the start of ``documents`` up to about ``limit_bytes`` of text."""
    seen = 0
    for document in documents:
        yield document
        seen += len(document)
        if seen >= limit_bytes:
            return


def train_tokenizer(documents: Iterable[str], vocab_size: int, eos_token: str = EOS_TOKEN) -> DatasetTokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens (the 256 bytes, the merges it
    finds and ``eos_token``) trained on the first :data:`TRAINING_SAMPLE_BYTES` of ``documents``."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < BYTE_TOKENS + 1:
        raise DatasetError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {BYTE_TOKENS + 1} tokens "
            f"(the 256 bytes and {eos_token})"
        )
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(
        sample_of(documents, TRAINING_SAMPLE_BYTES),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[eos_token],
        show_progress=False,
    )
    content = trained.to_str(pretty=True).encode()
    return DatasetTokenizer.from_json(content, "the trained tokenizer", eos_token)
