"""Indexing token shards made elsewhere (nanoGPT's ``train.bin`` and ``val.bin``).

The shards stay where they are, as they are: the index is written beside them.  Each
file is read once, to hash it and to check that it holds whole tokens below the
vocabulary size (a wrong ``--dtype`` shows up here, not as a garbled training run).
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Sequence

import numpy as np

from diloco_cli.data.tokens.index import (
    ITEM_BYTES,
    TOKENIZER_NAME,
    UNKNOWN_TOKENIZER,
    DatasetError,
    DatasetIndex,
    Dtype,
    ShardEntry,
)
from diloco_cli.data.tokens.prepare import is_complete_with
from diloco_cli.data.tokens.progress import Progress, Silent
from diloco_cli.data.tokens.storage import Location, Retry, call_once, join, remove_if_present, size_if_present
from diloco_cli.data.tokens.tokenizer import EOS_TOKEN, load_tokenizer
from diloco_cli.data.tokens.upload import write_index
from diloco_cli.store.filesystem import write_whole

READ_BLOCK_BYTES = 16 << 20


def shard_size(location: Location, name: str, dtype: Dtype, retry: Retry) -> int:
    """The size of shard ``name`` in bytes, which must be whole tokens."""
    filesystem, root = location.open()
    size = size_if_present(filesystem, join(root, name), retry)
    if size is None:
        raise DatasetError(f"{location.url}/{name} does not exist; name the shards with --train and --heldout")
    if size == 0 or size % ITEM_BYTES[dtype]:
        raise DatasetError(
            f"{location.url}/{name} has {size} bytes, not a whole number of {dtype} tokens; is --dtype right?"
        )
    return size


def hashed_shard(
    location: Location, name: str, size: int, dtype: Dtype, vocab_size: int, retry: Retry, progress: Progress
) -> ShardEntry:
    """The index entry of shard ``name``, read once: its hash, and every token checked
    to be below ``vocab_size``."""
    filesystem, root = location.open()
    path = join(root, name)
    digest, largest = hashlib.sha256(), 0
    for start in range(0, size, READ_BLOCK_BYTES):
        block = retry(
            lambda start=start: filesystem.cat_file(path, start=start, end=min(size, start + READ_BLOCK_BYTES))
        )
        digest.update(block)
        largest = max(largest, int(np.frombuffer(block, dtype=np.dtype(dtype).newbyteorder("<")).max()))
        progress.advance(len(block))
    if largest >= vocab_size:
        raise DatasetError(
            f"{location.url}/{name} holds token id {largest}, not below --vocab-size {vocab_size}; "
            "is --dtype or --vocab-size right?"
        )
    progress.done(name, reused=False)
    return ShardEntry(name=name, tokens=size // ITEM_BYTES[dtype], sha256=digest.hexdigest())


def index_existing(
    location: Location,
    *,
    dtype: Dtype,
    vocab_size: int,
    heldout: str = "val.bin",
    train: Sequence[str] = (),
    tokenizer: str | None = None,
    eos_token: str = EOS_TOKEN,
    overwrite: bool = False,
    retry: Retry = call_once,
    progress: Progress = Silent(),
) -> DatasetIndex:
    """Write the index of the shards in ``location``: ``train`` in that order (default:
    every ``*.bin`` there but ``heldout``, by name) and the held-out shard ``heldout``.
    With ``tokenizer`` (a ``tokenizer.json``) it is copied beside them and the index
    records its hash and end-of-document token; without, both are unknown.
    ``overwrite`` replaces an index there (made with another tokenizer); the shards stay."""
    loaded = load_tokenizer(tokenizer, {}, eos_token) if tokenizer is not None else None
    if loaded is not None and loaded.vocab_size > vocab_size:
        raise DatasetError(
            f"tokenizer {tokenizer} has {loaded.vocab_size} tokens, more than --vocab-size {vocab_size}; "
            f"give --vocab-size {loaded.vocab_size} (or more)"
        )
    tokenizer_sha256 = loaded.sha256 if loaded is not None else UNKNOWN_TOKENIZER
    filesystem, root = location.open()
    if overwrite:  # only the index: the shards are the ones to index
        remove_if_present(filesystem, join(root, location.index_name), retry)
    is_complete_with(location, tokenizer_sha256, retry)
    if not train:
        found = sorted(posixpath.basename(path) for path in retry(lambda: filesystem.glob(join(root, "*.bin"))))
        train = [name for name in found if name != heldout]
        if not train:
            raise DatasetError(
                f"{location.url} has no training shards (*.bin besides {heldout}); name them with --train"
            )
    if heldout in train:
        raise DatasetError(f"--heldout {heldout} is also a training shard; a held-out shard is never trained on")
    sizes = {name: shard_size(location, name, dtype, retry) for name in [*train, heldout]}
    progress.begin(f"checking the shards in {location.url}", sum(sizes.values()))
    entries = [hashed_shard(location, name, size, dtype, vocab_size, retry, progress) for name, size in sizes.items()]
    if loaded is not None:
        retry(lambda: write_whole(filesystem, join(root, TOKENIZER_NAME), loaded.content))
    index = DatasetIndex(
        dtype=dtype,
        vocab_size=vocab_size,
        tokenizer=TOKENIZER_NAME if loaded is not None else None,
        tokenizer_sha256=tokenizer_sha256,
        eos_token_id=loaded.eos_token_id if loaded is not None else None,
        train=tuple(entries[:-1]),
        heldout=entries[-1],
    )
    write_index(location, index, retry)
    return index
