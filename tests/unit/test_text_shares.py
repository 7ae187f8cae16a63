"""Byte-level text is dealt to learners in blocks, as a token dataset is: every process's
share is disjoint from the others' and holds an even part of every stretch of the text."""

import torch

from diloco_cli.data.text import TextSplit


def test_every_share_of_a_text_of_eight_kinds_holds_every_kind_evenly_and_no_byte_twice():
    """A corpus of 8 kinds of text one after the other (as Shakespeare's plays are): a
    contiguous quarter would hold 2 kinds; dealt blocks give each of 4 learners (of 2
    processes) about 1/8 of each kind, and no byte of the text to two of them."""
    kinds, length = 8, 80_000
    text = bytes(kind for kind in range(kinds) for _ in range(length)) + bytes(4_000)  # the tail is held out
    split = TextSplit.of(text, heldout_fraction=4_000 / len(text), context=64)
    positions = torch.arange(len(split.train), dtype=torch.int64)
    marked = TextSplit(train=positions, heldout=split.heldout)  # shares of positions: which bytes each got
    shares = [marked.share(learner, 4, seed=7, rank=rank, world_size=2) for learner in range(4) for rank in range(2)]
    taken = torch.cat(shares)
    assert len(set(taken.tolist())) == len(taken), "a byte went to two processes"
    assert len(taken) > 0.99 * len(split.train) and len({len(share) for share in shares}) == 1
    for share in shares:
        counts = torch.bincount(split.train[share].long(), minlength=kinds).float() / len(share)
        assert counts.min() > 0.6 / kinds and counts.max() < 1.4 / kinds, counts
    # the order of each process's blocks is drawn from the seed: another seed, another order
    assert not torch.equal(marked.share(0, 4, seed=7), marked.share(0, 4, seed=8))
