"""GPU tests build many engines in one process: each gives its device memory back when the
test ends (shut down, or collected here), so the next one finds the GPU as free as the first."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def free_device_memory_after_each_test() -> Iterator[None]:
    yield
    gc.collect()  # engines in reference cycles: their finalizers free the pools
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
