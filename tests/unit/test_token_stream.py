"""Streaming token datasets to learners: every batch against windows computed with numpy
from the concatenated tokens, and ranges that split the training tokens exactly (read-ahead
that hides a slow bucket and a memory limit below the corpus size:
tests/integration/test_token_stream_limits.py).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from diloco_cli.cli.app import app
from diloco_cli.data.tokens.existing import index_existing
from diloco_cli.data.tokens.index import DatasetError
from diloco_cli.data.tokens.ranges import process_range
from diloco_cli.data.tokens.storage import Location
from diloco_cli.data.tokens.stream import TokenBatches, heldout_tokens
from tests.support.token_windows import golden_batch

SHARD_SIZES = (1000, 2500, 700)
HELDOUT_TOKENS = 600
TRAIN_VOCAB = 60_000
"""Training tokens are below this; held-out ones at or above it (so any held-out token
that reached a batch would show)."""


def write_shards(directory: Path, seed: int = 0) -> np.ndarray:
    """nanoGPT-style ``train-*.bin`` (three of different sizes) and ``val.bin``; returns
    the concatenated training tokens."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    parts = [rng.integers(0, TRAIN_VOCAB, size, dtype=np.uint16) for size in SHARD_SIZES]
    for number, part in enumerate(parts):
        part.tofile(directory / f"train-{number}.bin")
    rng.integers(TRAIN_VOCAB, 1 << 16, HELDOUT_TOKENS, dtype=np.uint16).tofile(directory / "val.bin")
    return np.concatenate(parts)


def stream(
    directory: Path,
    shard: int = 0,
    num_shards: int = 1,
    rank: int = 0,
    world_size: int = 1,
    chunk_bytes: int = 600,
    cache_bytes: int = 4800,
    **options,
) -> TokenBatches:
    return TokenBatches(
        str(directory / "index.json"),
        options,
        shard=shard,
        num_shards=num_shards,
        rank=rank,
        world_size=world_size,
        chunk_bytes=chunk_bytes,
        cache_bytes=cache_bytes,
    )


@pytest.fixture
def dataset(tmp_path):
    tokens = write_shards(tmp_path / "data")
    index_existing(
        Location(str(tmp_path / "data")),
        dtype="uint16",
        vocab_size=1 << 16,
        train=["train-0.bin", "train-1.bin", "train-2.bin"],
    )
    return tmp_path / "data", tokens


@pytest.mark.parametrize(
    ("shard", "num_shards", "rank", "world_size"), [(0, 1, 0, 1), (1, 3, 0, 1), (1, 2, 1, 2), (2, 3, 1, 3)]
)
def test_batches_are_the_windows_of_the_concatenated_tokens(dataset, shard, num_shards, rank, world_size):
    """Every step, across file boundaries (tokens 1000 and 3500) and chunk boundaries (300
    tokens), around the end of the range (several epochs), and again at arbitrary steps
    in a fresh stream (a resume)."""
    directory, tokens = dataset
    total = len(tokens)
    learner_start, learner_end = shard * total // num_shards, (shard + 1) * total // num_shards
    start = learner_start + rank * (learner_end - learner_start) // world_size
    end = learner_start + (rank + 1) * (learner_end - learner_start) // world_size
    batch_size, sequence_length = 3, 40
    steps_per_epoch = (end - start - 1) // sequence_length // batch_size + 1
    with stream(directory, shard, num_shards, rank, world_size) as batches:
        assert (batches.range.start, batches.range.end) == (start, end)
        for step in range(3 * steps_per_epoch):
            inputs, targets = batches.batch_at(step, batch_size, sequence_length)
            expected = golden_batch(tokens, start, end, step, batch_size, sequence_length)
            assert inputs.dtype == targets.dtype == torch.int64
            assert inputs.shape == targets.shape == (batch_size, sequence_length)
            assert np.array_equal(inputs.numpy(), expected[:, :-1]) and np.array_equal(
                targets.numpy(), expected[:, 1:]
            ), step
    with stream(directory, shard, num_shards, rank, world_size) as resumed:
        for step in (2 * steps_per_epoch + 1, 5, 1000):
            inputs, _ = resumed.batch_at(step, batch_size, sequence_length)
            assert np.array_equal(
                inputs.numpy(), golden_batch(tokens, start, end, step, batch_size, sequence_length)[:, :-1]
            )


@given(total=st.integers(1, 10**12), num_shards=st.integers(1, 64), world_size=st.integers(1, 16))
def test_ranges_of_learners_and_ranks_are_disjoint_and_cover_every_training_token(total, num_shards, world_size):
    ranges = [
        process_range(total, shard, num_shards, rank, world_size)
        for shard in range(num_shards)
        for rank in range(world_size)
    ]
    assert ranges[0].start == 0 and ranges[-1].end == total
    assert all(before.end == after.start for before, after in zip(ranges, ranges[1:]))
    assert all(len(part) >= 0 for part in ranges) and max(map(len, ranges)) - min(map(len, ranges)) <= 2


def test_the_heldout_shard_never_reaches_a_training_batch(dataset):
    directory, tokens = dataset
    seen = []
    for shard in range(2):
        for rank in range(2):
            with stream(directory, shard, 2, rank, 2) as batches:
                windows = (len(batches.range) - 1) // 16
                for step in range(windows // 4 + 2):
                    seen.append(batches.batch_at(step, 4, 16)[1].numpy())
    assert np.concatenate([part.ravel() for part in seen]).max() < TRAIN_VOCAB
    heldout = heldout_tokens(str(directory / "index.json"), {}, 100)
    assert heldout.dtype == torch.int64 and len(heldout) == 100
    assert np.array_equal(heldout.numpy(), np.fromfile(directory / "val.bin", dtype=np.uint16)[:100])
    assert len(heldout_tokens(str(directory / "index.json"), {}, 10**9)) == HELDOUT_TOKENS


def test_nanogpt_shards_are_indexed_where_they_are_and_streamed(tmp_path):
    """``train.bin`` and ``val.bin`` as nanoGPT's prepare.py writes them (GPT-2 ids, uint16)."""
    rng = np.random.default_rng(3)
    train = rng.integers(0, 50257, 5000, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    rng.integers(0, 50257, 300, dtype=np.uint16).tofile(tmp_path / "val.bin")
    result = CliRunner().invoke(
        app, ["prepare", "--existing", str(tmp_path), "--dtype", "uint16", "--vocab-size", "50257"]
    )
    assert result.exit_code == 0, result.output
    assert f"index: {tmp_path}/index.json" in result.stdout
    with TokenBatches(
        f"file://{tmp_path}/index.json",
        {},
        shard=1,
        num_shards=2,
        rank=0,
        world_size=1,
        chunk_bytes=1 << 20,
        cache_bytes=4 << 20,
    ) as batches:
        assert batches.index.tokenizer is None and batches.tokenizer_sha256 == "unknown" and batches.vocab_size == 50257
        inputs, targets = batches.batch_at(4, 8, 64)
    expected = golden_batch(train, 2500, 5000, 4, 8, 64)
    assert np.array_equal(inputs.numpy(), expected[:, :-1]) and np.array_equal(targets.numpy(), expected[:, 1:])

    wrong = CliRunner().invoke(
        app, ["prepare", "--existing", str(tmp_path), "--dtype", "uint16", "--vocab-size", "1000", "--overwrite"]
    )
    assert wrong.exit_code == 2 and "not below --vocab-size 1000; is --dtype or --vocab-size right?" in wrong.stderr


def test_a_shard_shorter_than_its_index_says_is_reported(dataset):
    directory, _ = dataset
    with open(directory / "train-2.bin", "r+b") as handle:
        handle.truncate(100)
    with (
        stream(directory) as batches,
        pytest.raises(DatasetError, match="train-2.bin .* ends before token .*make it again"),
    ):
        for step in range(100):
            batches.batch_at(step, 4, 40)
