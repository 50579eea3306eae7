"""Counter-based random streams: the uniform of every output position of a seeded request.

Every sampled token is drawn with the uniform of its own position, so a seeded request's tokens
depend on its seed, prompt and parameters only: not on the batch it shares, on preemption, or on
how many drafts were verified around it.
"""

from __future__ import annotations

import numpy as np

_MASK_64 = (1 << 64) - 1
_GOLDEN_GAMMA, _MIX_1, _MIX_2 = (
    np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
)
_SHIFT_11, _SHIFT_27, _SHIFT_30, _SHIFT_31 = (np.uint64(n) for n in (11, 27, 30, 31))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def request_stream_seed(seed: int, sample_index: int) -> int:
    """The random stream of sample `sample_index` of a prompt seeded with `seed`: the `n`
    samples of one prompt differ from each other, but not from run to run."""
    assert sample_index >= 0, f"sample_index must be >= 0, got {sample_index}"
    return _splitmix64(_splitmix64(seed & _MASK_64) ^ sample_index)


def position_uniform(stream_seed: int, output_index: int) -> float:
    """The uniform in [0, 1) of one output position of one stream (counter-based: no state).

    Every sampled token is drawn with the uniform of its own position, so a seeded request's
    tokens depend on its seed, prompt and parameters only: not on the batch it shares, on
    preemption, or on how many drafts were verified around it.
    """
    return (_splitmix64(stream_seed ^ _splitmix64(output_index)) >> 11) * 2.0**-53


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` on a uint64 array (numpy's uint64 array arithmetic wraps mod 2**64)."""
    x = x + _GOLDEN_GAMMA
    x = (x ^ (x >> _SHIFT_30)) * _MIX_1
    x = (x ^ (x >> _SHIFT_27)) * _MIX_2
    return x ^ (x >> _SHIFT_31)


def position_uniforms(stream_seeds: np.ndarray, output_indices: np.ndarray) -> np.ndarray:
    """`position_uniform` for arrays of uint64 stream seeds and output indices: float64."""
    mixed = _splitmix64_array(stream_seeds ^ _splitmix64_array(output_indices.astype(np.uint64)))
    return (mixed >> _SHIFT_11).astype(np.float64) * 2.0**-53
