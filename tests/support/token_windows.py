"""The windows a token stream must give, computed one by one with numpy."""

import numpy as np

from diloco_cli.data.tokens.ranges import ProcessBlocks


def process_tokens(tokens: np.ndarray, blocks: ProcessBlocks) -> np.ndarray:
    """A process's tokens: its blocks of the concatenated training tokens, one after the other."""
    size = blocks.block_tokens
    return np.concatenate([tokens[block * size : (block + 1) * size] for block in blocks.blocks])


def golden_batch(part: np.ndarray, step: int, batch_size: int, sequence_length: int) -> np.ndarray:
    """Step ``step``'s windows of a process's tokens ``part``, one by one: window ``w`` is
    ``sequence_length + 1`` tokens from ``w * sequence_length``, ``w`` modulo the windows that fit."""
    windows = (len(part) - 1) // sequence_length
    rows = []
    for window in range(step * batch_size, (step + 1) * batch_size):
        first = window % windows * sequence_length
        rows.append(part[first : first + sequence_length + 1])
    return np.stack(rows).astype(np.int64)
