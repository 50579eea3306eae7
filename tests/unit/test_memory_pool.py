"""MemoryPool: aligned views into one address range, fixed capacity."""

import itertools
from collections.abc import Iterator

import pytest
import torch

from memory import ALIGNMENT_BYTES, MemoryManager, MemoryPool, PoolCapacityError


@pytest.fixture
def manager() -> Iterator[MemoryManager]:
    with MemoryManager("cpu") as manager:
        yield manager


def make_pool(manager: MemoryManager, num_bytes: int = 64 * 1024) -> MemoryPool:
    return manager.create_pool("weights", num_bytes)


def test_views_are_aligned_disjoint_and_in_range(manager: MemoryManager) -> None:
    pool = make_pool(manager)
    specs = [
        ((3,), torch.int8),
        ((5, 7), torch.float32),
        (11, torch.bfloat16),
        ((2, 3, 4), torch.int64),
    ]
    tensors = [pool.allocate(shape, dtype) for shape, dtype in specs]
    spans = []
    for tensor, (shape, dtype) in zip(tensors, specs):
        assert tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.shape == ((shape,) if isinstance(shape, int) else shape)
        offset = tensor.data_ptr() - pool.data_ptr
        assert offset % ALIGNMENT_BYTES == 0, offset
        spans.append((offset, offset + tensor.numel() * tensor.element_size()))
    for (_, end), (next_start, _) in itertools.pairwise(spans):
        assert end <= next_start
    assert spans[-1][1] == pool.num_allocated_bytes <= pool.num_bytes


def test_writes_land_in_pool_memory(manager: MemoryManager) -> None:
    pool = make_pool(manager)
    first = pool.allocate((4,), torch.int32)
    second = pool.allocate((2, 2), torch.float16)
    first.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    second.fill_(1.0)
    pool_bytes = pool.as_bytes()  # [num_bytes] uint8
    assert pool_bytes.numel() == pool.num_bytes
    assert pool_bytes[:16].view(torch.int32).tolist() == [1, 2, 3, 4]
    offset = second.data_ptr() - pool.data_ptr
    assert pool_bytes[offset : offset + 8].view(torch.float16).tolist() == [1.0] * 4


def test_allocation_past_capacity_raises_with_the_size_needed(manager: MemoryManager) -> None:
    pool = make_pool(manager, num_bytes=1000)
    pool.allocate((100,), torch.uint8)
    with pytest.raises(PoolCapacityError, match=r"num_bytes >= 1256"):
        pool.allocate((250,), torch.float32)
    assert pool.num_allocated_bytes == 100  # the failed call changed nothing
    exact = pool.allocate((1000 - 256,), torch.uint8)
    assert exact.data_ptr() - pool.data_ptr == 256 and pool.num_free_bytes == 0


def test_capacity_is_the_asked_size_even_when_the_backend_rounds_up(manager: MemoryManager) -> None:
    pool = make_pool(manager, num_bytes=5000)
    assert pool.num_bytes == 5000 and pool.region.num_bytes >= 5000
    with pytest.raises(PoolCapacityError):
        pool.allocate((5001,), torch.uint8)


def test_reset_hands_out_the_same_addresses_again(manager: MemoryManager) -> None:
    pool = make_pool(manager)
    first = pool.allocate((16,), torch.float32)
    pool.reset()
    assert pool.num_allocated_bytes == 0
    again = pool.allocate((16,), torch.float32)
    assert again.data_ptr() == first.data_ptr() == pool.data_ptr


def test_zero_sized_tensor(manager: MemoryManager) -> None:
    pool = make_pool(manager)
    empty = pool.allocate((0, 8), torch.float32)
    assert empty.shape == (0, 8)
    assert pool.allocate((1,), torch.float32).data_ptr() >= empty.data_ptr()
