"""Launch-side helpers shared by the Triton kernels (no Triton import, so it is cheap to load)."""

from __future__ import annotations

import functools
import os

import torch


def is_interpreting() -> bool:
    """True under `TRITON_INTERPRET=1`: kernels run on CPU tensors, with no autotuning."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def batch_invariant_runs_triton(t: torch.Tensor) -> bool:
    """Whether the batch-invariant ops on `t` run the Triton kernels
    (`kernels/triton_batch_invariant.py`): CUDA tensors, and CPU tensors under
    TRITON_INTERPRET=1 with ROLLOUT_ENGINE_BI_TRITON=1 (how the tests run them without a GPU)."""
    return t.is_cuda or (t.device.type == "cpu" and is_interpreting()
                         and os.environ.get("ROLLOUT_ENGINE_BI_TRITON") == "1")


def check_device(*tensors: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or CPU tensors when interpreting."""
    if is_interpreting():
        return
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(
                f"Triton kernels need CUDA tensors, got one on {t.device}; use the torch "
                "reference (kernels.dispatch does so off CUDA) or set TRITON_INTERPRET=1"
            )


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (how many programs run at once, roughly)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` precision: exact fp32 ("ieee", not TF32) for fp32 inputs, so fp32 matches torch."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
