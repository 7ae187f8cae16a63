"""Byte-level text data: the built-in corpus, disjoint shares and random batches.

Every process of every learner reads only its own share of the training text, so no two
see the same bytes: the text is cut into blocks dealt out like cards, as a token
dataset's are (:func:`~diloco_cli.data.tokens.ranges.process_blocks`), so that each
share holds an even part of every stretch of the text (a contiguous quarter of a corpus
is another kind of text than the next: Shakespeare's plays one after the other). The
last part of the text is held out for evaluating the global model. Data can be any text
at an fsspec URL (``s3://bucket/corpus.txt``) or the built-in corpus
(``builtin:shakespeare``), which ships with the package and is checked by hash: nothing
is fetched from a hub at run time (:mod:`~diloco_cli.data.corpora`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco_cli.data.corpora import BUILTIN_PREFIX, DataError, builtin_corpus


def load_text(source: str, storage_options: dict | None = None) -> bytes:
    """The bytes of a data source: ``builtin:NAME`` or an fsspec URL to a text file."""
    if source.startswith(BUILTIN_PREFIX):
        return builtin_corpus(source[len(BUILTIN_PREFIX) :])
    import fsspec

    try:
        with fsspec.open(source, "rb", **(storage_options or {})) as handle:
            return handle.read()
    except FileNotFoundError:
        raise DataError(f"data file {source} does not exist") from None


@dataclass(frozen=True)
class TextSplit:
    """The training text and the held-out text of a corpus."""

    train: torch.Tensor
    heldout: torch.Tensor

    @classmethod
    def of(cls, text: bytes, heldout_fraction: float, context: int) -> TextSplit:
        """Hold out the last ``heldout_fraction`` of the text (at least one sequence)."""
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        heldout_length = max(context + 1, int(len(tokens) * heldout_fraction))
        if len(tokens) < heldout_length + 2 * (context + 1):
            raise DataError(f"the text has {len(tokens)} bytes, too few for a context of {context}")
        return cls(train=tokens[:-heldout_length], heldout=tokens[-heldout_length:])

    def share(
        self, shard: int, num_shards: int, seed: int, rank: int = 0, world_size: int = 1, block_bytes: int = 1 << 22
    ) -> torch.Tensor:
        """Process ``rank`` of ``world_size`` of learner ``shard`` of ``num_shards``: its
        blocks of the training text (at most ``block_bytes`` each, at least 64 per process
        where the text allows), in the order ``seed`` draws, one after the other."""
        from diloco_cli.data.tokens.ranges import process_blocks

        blocks = process_blocks(len(self.train), shard, num_shards, rank, world_size, block_bytes, seed)
        size = blocks.block_tokens
        return torch.cat([self.train[block * size : (block + 1) * size] for block in blocks.blocks])


def random_batch(
    tokens: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``context`` bytes and their next-byte targets."""
    if len(tokens) <= context + 1:
        raise DataError(f"a shard of {len(tokens)} bytes is too small for a context of {context}")
    starts = torch.randint(0, len(tokens) - context - 1, (batch_size,), generator=generator)
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets].long()
    return windows[:, :-1], windows[:, 1:]


def evaluation_batches(
    tokens: torch.Tensor, batch_size: int, context: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced windows over held-out text: the same every evaluation."""
    count = min(max_batches * batch_size, (len(tokens) - 1) // context)
    stride = (len(tokens) - context - 1) // max(1, count - 1) if count > 1 else 0
    starts = torch.arange(count) * stride
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets].long()
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in windows.split(batch_size)]
