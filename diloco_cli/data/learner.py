"""A learner's training batches and the syncer's held-out batches, from text or tokens.

Text (the built-in corpus, or a text file at an fsspec URL) is loaded whole and trained
byte by byte: each process draws random windows from its own share, blocks of the text
dealt out as a token dataset's are, with a generator whose state travels in the
checkpoint. A token dataset (``diloco prepare``) is streamed: each process reads only
its own blocks, dealt from the whole dataset, by ranged reads, the batch of step s being
a pure function of s, so a resumed learner resumes its data exactly. Either way a
learner reads its region's copy of the data when the region names one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from diloco_cli.config.recipe import Recipe, RetryPolicy
from diloco_cli.data.text import TextSplit, evaluation_batches, load_text, random_batch
from diloco_cli.store.metering import StorageMeter
from diloco_cli.store.retry import call_with_retries
from diloco_cli.store.run_spec import LearnerSpec, RunSpec

MEGABYTE = 1 << 20


class LearnerData(Protocol):
    """The batches of one learner process; also its data position for checkpoints."""

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for inner step ``step``."""

    def state(self) -> str: ...

    def restore(self, state: str | None, step: int) -> None: ...

    def close(self) -> None: ...


def generator_state(generator: torch.Generator) -> str:
    """A data generator's position as text (stored in checkpoint metadata)."""
    return bytes(generator.get_state().tolist()).hex()


def restore_generator(generator: torch.Generator, state: str) -> None:
    """Put ``generator`` back at the position :func:`generator_state` wrote."""
    generator.set_state(torch.tensor(list(bytes.fromhex(state)), dtype=torch.uint8))


def data_generator(seed: int, shard: int, rank: int, step: int) -> torch.Generator:
    """The generator of a learner's batches, independent for every (seed, shard, rank)
    and reproducible from any step a learner must restart at without its checkpoint."""
    state = np.random.SeedSequence([seed, shard, rank, step]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


class TextWindows:
    """Random windows of a process's slice of the text (the byte-level default)."""

    def __init__(self, tokens: torch.Tensor, sequence_length: int, seed: int, shard: int, rank: int) -> None:
        self.tokens, self.sequence_length = tokens, sequence_length
        self.seed, self.shard, self.rank = seed, shard, rank
        self.generator = data_generator(seed, shard, rank, 0)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(self.tokens, batch_size, self.sequence_length, self.generator)

    def state(self) -> str:
        return generator_state(self.generator)

    def restore(self, state: str | None, step: int) -> None:
        if state is None:
            self.generator = data_generator(self.seed, self.shard, self.rank, step)
        else:
            restore_generator(self.generator, state)

    def close(self) -> None:
        pass


class TokenWindows:
    """Consecutive windows of a process's token range, streamed (the batch of a step is
    determined by the step, so there is no state to save)."""

    def __init__(self, batches: Any, sequence_length: int) -> None:
        self.batches, self.sequence_length = batches, sequence_length

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches.batch_at(step, batch_size, self.sequence_length)

    def state(self) -> str:
        return ""

    def restore(self, state: str | None, step: int) -> None:
        pass

    def close(self) -> None:
        self.batches.close()


def retried_reads(policy: RetryPolicy, source: str) -> Callable[[Callable[[], bytes]], bytes]:
    """Each ranged read of a dataset under the run's retry policy."""
    meter = StorageMeter()
    return lambda read: call_with_retries(read, policy, meter, f"reading {source}", kind="other")


def data_source(spec: RunSpec, learner: LearnerSpec) -> tuple[str, dict]:
    """The URL and filesystem options a learner reads: its region's copy, if it has one."""
    region = spec.region(learner.region)
    if region.data_source:
        return region.data_source, region.data_storage_options
    return spec.recipe.data.source, spec.recipe.data.storage_options


def open_learner_data(
    spec: RunSpec, learner: LearnerSpec, rank: int, world_size: int, partition: tuple[int, int] | None = None
) -> LearnerData:
    """The batches of process ``rank`` of ``world_size`` of this learner, from slice
    ``partition`` = (index, count) of the data (default: the learner's at start)."""
    data, seed = spec.recipe.data, spec.recipe.training.seed
    source, options = data_source(spec, learner)
    shard, num_shards = partition or spec.data_partition(learner.id)
    if data.is_tokens:
        from diloco_cli.data.tokens.stream import TokenBatches

        batches = TokenBatches(
            source,
            options,
            shard=shard,
            num_shards=num_shards,
            rank=rank,
            world_size=world_size,
            chunk_bytes=int(data.chunk_megabytes * MEGABYTE),
            cache_bytes=int(data.cache_megabytes * MEGABYTE),
            seed=seed,
            read_retry=retried_reads(spec.recipe.storage, source),
        )
        return TokenWindows(batches, data.sequence_length)
    split = TextSplit.of(load_text(source, options), data.heldout_fraction, data.sequence_length)
    share = split.share(shard, num_shards, seed, rank, world_size, int(data.chunk_megabytes * MEGABYTE))
    return TextWindows(share, data.sequence_length, seed, shard, rank)


def heldout_batches(recipe: Recipe) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches the syncer evaluates the global model on."""
    data, batch_size = recipe.data, recipe.training.batch_size
    if data.is_tokens:
        from diloco_cli.data.tokens.stream import heldout_tokens

        wanted = recipe.sync.evaluation_batches * batch_size * data.sequence_length + 1
        tokens = heldout_tokens(
            data.source, data.storage_options, wanted, read_retry=retried_reads(recipe.storage, data.source)
        )
    else:
        tokens = TextSplit.of(
            load_text(data.source, data.storage_options), data.heldout_fraction, data.sequence_length
        ).heldout
    return evaluation_batches(tokens, batch_size, data.sequence_length, recipe.sync.evaluation_batches)
