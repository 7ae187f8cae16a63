"""Streaming a learner's training tokens from a dataset by ranged reads.

A process reads only its own blocks of the training tokens, dealt from the whole stream
(:mod:`~diloco_cli.data.tokens.ranges`), each block by one ``cat_file(path, start, end)``
of at most ``chunk_bytes`` (a block may span two shard files), never a whole shard.
While a step trains on the blocks it needs, the next ones in reading order are read
ahead on background threads, and no more than ``cache_bytes`` of them are held at once
(:class:`~diloco_cli.data.tokens.chunks.ChunkCache`).  A step's windows are a function
of the step alone, so :meth:`TokenBatches.batch_at` at any step (a resume) reads what an
uninterrupted run would have read there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from diloco_cli.data.tokens.chunks import ChunkCache
from diloco_cli.data.tokens.index import DatasetError, DatasetIndex
from diloco_cli.data.tokens.ranges import FileLayout, Segment, process_blocks, window_runs, windows_per_epoch
from diloco_cli.data.tokens.storage import Location, call_once, join, read_index

ReadRetry = Callable[[Callable[[], bytes]], bytes]

READ_AHEAD_CHUNKS = 4
"""Chunks read ahead of the current batch, each on its own thread: over a link of
round trip r, the reader keeps up with about ``READ_AHEAD_CHUNKS * chunk_bytes / r``."""


class ShardReader:
    """Ranged reads of a dataset's shards, checked against the index's sizes."""

    def __init__(self, index_url: str, storage_options: dict[str, Any], read_retry: ReadRetry | None) -> None:
        self.location = Location.of_index(index_url, storage_options)
        self.retry = read_retry or call_once
        self.index: DatasetIndex = read_index(self.location, self.retry)
        self.filesystem, self.directory = self.location.open()
        self.dtype = np.dtype(self.index.dtype).newbyteorder("<")

    def read(self, name: str, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of shard ``name``."""
        item = self.dtype.itemsize
        path = join(self.directory, name)
        data = self.retry(lambda: self.filesystem.cat_file(path, start=start * item, end=end * item))
        if len(data) != (end - start) * item:
            raise DatasetError(
                f"shard {name} beside {self.location.index_url} ends before token {end}, "
                "where its index says it holds more; "
                "the dataset is damaged or was changed after `diloco prepare`: make it again"
            )
        return np.frombuffer(data, dtype=self.dtype)


class TokenBatches:
    """Batches of one process's blocks of a token dataset's training tokens.

    Learner ``shard`` of ``num_shards``, process ``rank`` of ``world_size``, blocks dealt
    in the order ``seed`` draws (see :func:`~diloco_cli.data.tokens.ranges.process_blocks`;
    every process of a run must be given the same seed); ``read_retry`` runs each ranged
    read under the caller's retry policy.
    """

    def __init__(
        self,
        index_url: str,
        storage_options: dict[str, Any],
        *,
        shard: int,
        num_shards: int,
        rank: int,
        world_size: int,
        chunk_bytes: int,
        cache_bytes: int,
        seed: int,
        read_retry: ReadRetry | None = None,
    ) -> None:
        self._reader = ShardReader(index_url, storage_options, read_retry)
        self.index = self._reader.index
        self._layout = FileLayout([entry.tokens for entry in self.index.train])
        self.blocks = process_blocks(
            self._layout.total,
            shard,
            num_shards,
            rank,
            world_size,
            max(1, chunk_bytes // self.index.item_bytes),
            seed,
        )
        self._chunk_tokens = self.blocks.block_tokens  # a block is read at once: the cache's unit
        capacity = cache_bytes // (self._chunk_tokens * self.index.item_bytes)
        if capacity < 2:
            raise DatasetError(
                f"a cache of {cache_bytes / 2**20:g} MB holds fewer than two chunks of {chunk_bytes / 2**20:g} MB "
                "(the one in use and the one read ahead); raise data.cache_megabytes or lower data.chunk_megabytes"
            )
        self._cache = ChunkCache(self._read_chunk, capacity, threads=READ_AHEAD_CHUNKS)

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.index.eos_token_id

    @property
    def tokenizer_sha256(self) -> str:
        return self.index.tokenizer_sha256

    def _read_chunk(self, chunk: int) -> np.ndarray:
        """This process's block number ``chunk``, from one or more shard files."""
        start = self.blocks.start_of(chunk)
        end = start + self._chunk_tokens
        pieces = self._layout.segments(start, end)
        if len(pieces) == 1:
            return self._read_segment(pieces[0])
        tokens = np.empty(end - start, dtype=self._reader.dtype)
        offset = 0
        for piece in pieces:
            tokens[offset : offset + piece.end - piece.start] = self._read_segment(piece)
            offset += piece.end - piece.start
        return tokens

    def _read_segment(self, piece: Segment) -> np.ndarray:
        return self._reader.read(self.index.train[piece.file].name, piece.start, piece.end)

    def _chunks_of(self, start: int, end: int) -> range:
        return range(start // self._chunk_tokens, (end - 1) // self._chunk_tokens + 1)

    def _tokens(self, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of this process's tokens (its blocks one after the
        other), from held chunks."""
        tokens = np.empty(end - start, dtype=self._reader.dtype)
        for chunk in self._chunks_of(start, end):
            first = chunk * self._chunk_tokens
            low, high = max(start, first), min(end, first + self._chunk_tokens)
            tokens[low - start : high - start] = self._cache.get(chunk)[low - first : high - first]
        return tokens

    def batch_at(self, step: int, batch_size: int, sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets (int64, ``[batch_size, sequence_length]``) of
        inner step ``step`` (from 0): windows ``step * batch_size`` onwards of this
        process's tokens, wrapping around at their end (see :mod:`~diloco_cli.data.tokens.ranges`)."""
        windows = windows_per_epoch(self.blocks.tokens, sequence_length)
        spans = [
            (first * sequence_length, (first + count) * sequence_length + 1)
            for first, count in window_runs(step, batch_size, windows)
        ]
        needed = [chunk for start, end in spans for chunk in self._chunks_of(start, end)]
        if len(set(needed)) > self._cache.capacity:
            raise DatasetError(
                f"a batch of {batch_size} x {sequence_length + 1} tokens spans {len(set(needed))} chunks, "
                "more than the "
                f"{self._cache.capacity} the cache holds; raise data.cache_megabytes"
            )
        chunks_in_use = windows * sequence_length // self._chunk_tokens + 1  # up to the last token any window reads
        read_ahead = [(needed[-1] + ahead) % chunks_in_use for ahead in range(1, READ_AHEAD_CHUNKS + 1)]
        self._cache.hold(needed + read_ahead)
        rows = [
            np.lib.stride_tricks.sliding_window_view(self._tokens(start, end), sequence_length + 1)[::sequence_length]
            for start, end in spans
        ]
        tokens = torch.from_numpy(np.concatenate(rows).astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]

    def close(self) -> None:
        """Stop reading ahead and let go of every chunk."""
        self._cache.close()

    def __enter__(self) -> TokenBatches:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def heldout_tokens(
    index_url: str, storage_options: dict[str, Any], max_tokens: int, read_retry: ReadRetry | None = None
) -> torch.Tensor:
    """The first ``max_tokens`` tokens (or all, if fewer) of the dataset's held-out shard,
    as int64, to evaluate the global model on."""
    reader = ShardReader(index_url, storage_options, read_retry)
    heldout = reader.index.heldout
    return torch.from_numpy(reader.read(heldout.name, 0, min(max_tokens, heldout.tokens)).astype(np.int64))
