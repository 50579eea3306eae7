"""What this CPU computes natively, asked where a choice depends on it (the dtype a checkpoint
runs in, the dtype a packed linear computes in)."""

from __future__ import annotations

import torch


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX-512 BF16; AMX CPUs have it too). Asked at
    every call, not cached: tests answer it both ways."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe is not None and probe())
