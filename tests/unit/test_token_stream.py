"""Streaming token datasets to learners: every batch against windows computed with numpy
from the concatenated tokens, and ranges that split the training tokens exactly (read-ahead
that hides a slow bucket and a memory limit below the corpus size:
tests/integration/test_token_stream_limits.py).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from diloco_cli.cli.app import app
from diloco_cli.data.tokens.existing import index_existing
from diloco_cli.data.tokens.index import DatasetError
from diloco_cli.data.tokens.ranges import process_blocks
from diloco_cli.data.tokens.storage import Location
from diloco_cli.data.tokens.stream import TokenBatches, heldout_tokens
from tests.support.token_windows import golden_batch, process_tokens

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
    seed: int = 0,
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
        seed=seed,
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
def test_batches_are_the_windows_of_the_process_blocks(dataset, shard, num_shards, rank, world_size):
    """Every step, across file boundaries (tokens 1000 and 3500) and block boundaries,
    around the end of the process's tokens (several epochs), and again at arbitrary steps
    in a fresh stream (a resume)."""
    directory, tokens = dataset
    batch_size, sequence_length = 3, 40
    with stream(directory, shard, num_shards, rank, world_size) as batches:
        mine = process_tokens(tokens, batches.blocks)
        steps_per_epoch = (len(mine) - 1) // sequence_length // batch_size + 1
        assert len(batches.blocks.blocks) > 1
        for step in range(3 * steps_per_epoch):
            inputs, targets = batches.batch_at(step, batch_size, sequence_length)
            expected = golden_batch(mine, step, batch_size, sequence_length)
            assert inputs.dtype == targets.dtype == torch.int64
            assert inputs.shape == targets.shape == (batch_size, sequence_length)
            assert np.array_equal(inputs.numpy(), expected[:, :-1]) and np.array_equal(
                targets.numpy(), expected[:, 1:]
            ), step
    with stream(directory, shard, num_shards, rank, world_size) as resumed:
        for step in (2 * steps_per_epoch + 1, 5, 1000):
            inputs, _ = resumed.batch_at(step, batch_size, sequence_length)
            assert np.array_equal(inputs.numpy(), golden_batch(mine, step, batch_size, sequence_length)[:, :-1])


@given(
    total=st.integers(1, 10**7),
    num_shards=st.integers(1, 16),
    world_size=st.integers(1, 4),
    chunk_tokens=st.integers(256, 1 << 21),
    seed=st.integers(-(2**31), 2**31),
)
def test_blocks_of_learners_and_ranks_are_disjoint_equal_and_cover_the_stream(
    total, num_shards, world_size, chunk_tokens, seed
):
    parts = num_shards * world_size
    if total < parts:
        with pytest.raises(DatasetError, match="cannot be shared among"):
            process_blocks(total, 0, num_shards, 0, world_size, chunk_tokens, seed)
        return
    layouts = [
        process_blocks(total, shard, num_shards, rank, world_size, chunk_tokens, seed)
        for shard in range(num_shards)
        for rank in range(world_size)
    ]
    size = layouts[0].block_tokens
    assert all(layout.block_tokens == size for layout in layouts)
    assert size <= max(chunk_tokens, 1) or len(layouts[0].blocks) == 1
    counts = {len(layout.blocks) for layout in layouts}
    assert len(counts) == 1  # every process gets as many blocks
    blocks = [block for layout in layouts for block in layout.blocks]
    assert sorted(blocks) == list(range(len(blocks)))  # no block twice, none left out
    assert total - len(blocks) < size * len(blocks) <= total  # all but fewer tokens than there are blocks


def test_the_heldout_shard_never_reaches_a_training_batch(dataset):
    directory, tokens = dataset
    seen = []
    for shard in range(2):
        for rank in range(2):
            with stream(directory, shard, 2, rank, 2) as batches:
                windows = (batches.blocks.tokens - 1) // 16
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
        seed=0,
    ) as batches:
        assert batches.index.tokenizer is None and batches.tokenizer_sha256 == "unknown" and batches.vocab_size == 50257
        inputs, targets = batches.batch_at(4, 8, 64)
        expected = golden_batch(process_tokens(train, batches.blocks), 4, 8, 64)
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


def unigram(tokens: np.ndarray, vocabulary: int) -> np.ndarray:
    counts = np.bincount(tokens, minlength=vocabulary).astype(np.float64) + 0.5  # smoothed: no empty bin
    return counts / counts.sum()


def largest_kl(distributions: list[np.ndarray]) -> float:
    """The largest KL divergence (nats) between any two of the distributions, either way."""
    return max(
        float(np.sum(p * np.log(p / q)))
        for i, p in enumerate(distributions)
        for j, q in enumerate(distributions)
        if i != j
    )


SORTED_KINDS, KIND_VOCABULARY, VOCABULARY = 8, 1500, 4000
LEARNERS, FIRST_TOKENS = 4, 1 << 20
KL_BOUND = 0.05
"""Nats: the largest unigram KL divergence between two learners' first million tokens
that a sorted corpus may leave (dealt blocks gave 0.004, contiguous ranges 8.6)."""


def test_every_learner_sees_the_same_distribution_of_a_sorted_corpus(tmp_path):
    """A corpus sorted by kind of text (8 kinds, each its own vocabulary, one after the
    other, like source files sorted by name): the learners' first million tokens have
    near-equal unigram distributions, where contiguous ranges would give each learner
    other kinds of text."""
    rng = np.random.default_rng(0)
    per_kind = 2 * LEARNERS * FIRST_TOKENS // SORTED_KINDS  # each learner gets 2M tokens, reads 1M
    ranks = np.arange(1, KIND_VOCABULARY + 1)
    zipf = (1 / ranks) / (1 / ranks).sum()
    kinds = [
        (kind * (VOCABULARY - KIND_VOCABULARY) // (SORTED_KINDS - 1) + rng.choice(KIND_VOCABULARY, per_kind, p=zipf))
        for kind in range(SORTED_KINDS)
    ]
    tokens = np.concatenate(kinds).astype(np.uint16)
    directory = tmp_path / "sorted"
    directory.mkdir()
    tokens.tofile(directory / "train.bin")
    tokens[:5000].tofile(directory / "val.bin")
    index_existing(Location(str(directory)), dtype="uint16", vocab_size=VOCABULARY)

    dealt = []
    for shard in range(LEARNERS):
        with TokenBatches(
            str(directory / "index.json"),
            {},
            shard=shard,
            num_shards=LEARNERS,
            rank=0,
            world_size=1,
            chunk_bytes=4 << 20,  # the recipe's defaults
            cache_bytes=64 << 20,
            seed=0,
        ) as batches:
            steps = FIRST_TOKENS // (64 * 1024)
            inputs = [batches.batch_at(step, 64, 1024)[0].numpy().ravel() for step in range(steps)]
        dealt.append(unigram(np.concatenate(inputs), VOCABULARY))
    contiguous = [
        unigram(tokens[shard * len(tokens) // LEARNERS :][:FIRST_TOKENS].astype(np.int64), VOCABULARY)
        for shard in range(LEARNERS)
    ]
    assert largest_kl(contiguous) > 1.0 > KL_BOUND
    assert largest_kl(dealt) < KL_BOUND, largest_kl(dealt)
