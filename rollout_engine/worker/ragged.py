"""Index arithmetic for ragged batches (runs of different lengths laid end to end)."""

from __future__ import annotations

import numpy as np


def index_within_runs(lengths: np.ndarray) -> np.ndarray:
    """For runs of `lengths` laid end to end, each element's index inside its run:
    [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
