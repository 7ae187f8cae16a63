"""The index of a token dataset: a small JSON document beside its shards.

A shard is a flat array of little-endian ``uint16`` or ``uint32`` token ids with no
header, the layout nanoGPT's ``prepare.py`` writes (``train.bin``, ``val.bin``), so
shards made elsewhere can be indexed as they are.  The index names the training shards
in order (their concatenation is the training token stream), one held-out shard for
evaluation, the tokenizer and its hash.  ``diloco prepare`` writes it last: a dataset
without an index is unfinished and nothing reads it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from diloco_cli.config.errors import ConfigError

FROZEN = ConfigDict(frozen=True, extra="forbid")

FORMAT = "diloco-tokens/1"
"""The index's format tag; a reader refuses any other."""

INDEX_NAME = "index.json"
TOKENIZER_NAME = "tokenizer.json"

UNKNOWN_TOKENIZER = "unknown"
"""``tokenizer_sha256`` of shards indexed without their tokenizer (``prepare --existing``)."""

Dtype = Literal["uint16", "uint32"]

ITEM_BYTES: dict[str, int] = {"uint16": 2, "uint32": 4}


def _inside_the_directory(name: str) -> str:
    if ".." in name.split("/"):
        raise ValueError(f"{name!r} leaves the index's directory")
    return name


RelativeName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-][A-Za-z0-9_./-]*$"), AfterValidator(_inside_the_directory)]
"""A path relative to the index, inside its directory (no ``..``, no leading ``/``)."""


class DatasetError(ConfigError):
    """A dataset or corpus cannot be used as asked; the message names the URL (and key)
    and says what to do.  A :class:`ConfigError` (so a ``ValueError``): every command
    reports it as one line."""


def dtype_for_vocabulary(vocab_size: int) -> Dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class ShardEntry(BaseModel):
    """One shard file."""

    model_config = FROZEN

    name: RelativeName
    """File name relative to the index's directory."""

    tokens: int = Field(ge=1)
    """Tokens in the file (its size over the dtype's item size)."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of the file's bytes."""


class DatasetIndex(BaseModel):
    """What a token dataset holds and how its shards are laid out."""

    model_config = FROZEN

    format: Literal["diloco-tokens/1"] = FORMAT
    """The format tag."""

    dtype: Dtype
    """Token id type of every shard, little-endian."""

    vocab_size: int = Field(ge=1)
    """Every token id is below this."""

    tokenizer: RelativeName | None = None
    """The tokenizer's ``tokenizer.json`` (Hugging Face ``tokenizers``) beside the index,
    or null when the shards came without one."""

    tokenizer_sha256: str = Field(pattern=rf"^([0-9a-f]{{64}}|{UNKNOWN_TOKENIZER})$")
    """SHA-256 of the tokenizer file's content; ``unknown`` for shards indexed without it.
    Datasets made with different tokenizers never share a location."""

    eos_token_id: int | None = Field(default=None, ge=0)
    """The token that ends every document, or null when unknown."""

    train: tuple[ShardEntry, ...] = Field(min_length=1)
    """The training shards in order: their concatenation is the training token stream."""

    heldout: ShardEntry
    """The held-out shard, never trained on, for evaluating the global model."""

    @model_validator(mode="after")
    def _consistent(self) -> DatasetIndex:
        if self.dtype == "uint16" and self.vocab_size > 1 << 16:
            raise ValueError(f"vocab_size {self.vocab_size} does not fit uint16 token ids; use uint32")
        if self.eos_token_id is not None and self.eos_token_id >= self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is not below vocab_size {self.vocab_size}")
        names = [shard.name for shard in (*self.train, self.heldout)]
        if len(set(names)) != len(names):
            raise ValueError("a shard is named twice (the held-out shard must be none of the training shards)")
        return self

    @property
    def item_bytes(self) -> int:
        return ITEM_BYTES[self.dtype]

    @property
    def train_tokens(self) -> int:
        return sum(shard.tokens for shard in self.train)

    def to_json(self) -> bytes:
        return (self.model_dump_json(indent=2) + "\n").encode()


def parse_document(model: type[BaseModel], data: bytes, url: str, what_to_do: str) -> Any:
    """Validate a JSON document a diloco command wrote, or say in one line what is wrong
    with it (``url``, the key) and what to do."""
    from diloco_cli.config.loading import describe_validation_error

    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep, a number too long
        raise DatasetError(
            f"{url} is not JSON we can read ({type(error).__name__}: {str(error)[:200]}); {what_to_do}"
        ) from None
    if isinstance(document, dict) and document.get("format", FORMAT) != FORMAT:
        raise DatasetError(
            f"{url} has format {document['format']!r}, this diloco reads {FORMAT!r}; "
            f"use the diloco that wrote it, or {what_to_do}"
        )
    try:
        return model.model_validate(document)
    except ValidationError as error:
        raise DatasetError(f"{describe_validation_error(error, model, url)}; {what_to_do}") from None


def parse_index(data: bytes, url: str) -> DatasetIndex:
    """The index at ``url`` from its bytes."""
    return parse_document(DatasetIndex, data, url, "make the dataset again with `diloco prepare`")
