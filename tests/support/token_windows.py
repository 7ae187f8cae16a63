"""The windows a token stream must give, computed one by one with numpy."""

import numpy as np


def golden_batch(
    tokens: np.ndarray, start: int, end: int, step: int, batch_size: int, sequence_length: int
) -> np.ndarray:
    """Step ``step``'s windows of ``tokens[start:end]``, one by one: window ``w`` is
    ``sequence_length + 1`` tokens from ``w * sequence_length``, ``w`` modulo the windows that fit."""
    part = tokens[start:end]
    windows = (len(part) - 1) // sequence_length
    rows = []
    for window in range(step * batch_size, (step + 1) * batch_size):
        first = window % windows * sequence_length
        rows.append(part[first : first + sequence_length + 1])
    return np.stack(rows).astype(np.int64)
