"""A fixed-capacity pool of one tag: tensors are aligned views into one stable address range."""

import math
from collections.abc import Sequence

import torch

from memory.backend import MemoryBackend, Region
from memory.errors import PoolCapacityError

ALIGNMENT_BYTES = 256
"""Every tensor a pool hands out starts at a multiple of this many bytes from the base."""


class MemoryPool:
    """Bump allocator over a region that the manager maps and unmaps as a whole."""

    def __init__(self, tag: str, num_bytes: int, backend: MemoryBackend, region: Region) -> None:
        assert region.num_bytes >= num_bytes, (region.num_bytes, num_bytes)
        self.tag = tag
        self.num_bytes = num_bytes
        self._backend = backend
        self._region = region
        self._num_allocated_bytes = 0

    @property
    def data_ptr(self) -> int:
        """Base address of the pool; the same for the pool's whole life."""
        return self._region.base_ptr

    @property
    def is_mapped(self) -> bool:
        """Whether physical memory backs the pool right now."""
        return self._region.is_mapped

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def num_allocated_bytes(self) -> int:
        """Bytes handed out so far, alignment padding included."""
        return self._num_allocated_bytes

    @property
    def num_free_bytes(self) -> int:
        return self.num_bytes - self._num_allocated_bytes

    def allocate(self, shape: Sequence[int] | torch.Size | int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` and `dtype` viewing the pool's memory.

        Its content is whatever the pool holds (zero in a fresh CPU pool). Touching it while
        the pool is unmapped reads zeros on CPU and faults on CUDA.
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        num_tensor_bytes = math.prod(shape) * dtype.itemsize
        offset = -(-self._num_allocated_bytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES
        if offset + num_tensor_bytes > self.num_bytes:
            raise PoolCapacityError(
                f"pool {self.tag!r} cannot fit a {list(shape)} {dtype} tensor "
                f"({num_tensor_bytes} bytes): {offset} of its {self.num_bytes} bytes are in use; "
                f"create the pool with num_bytes >= {offset + num_tensor_bytes}"
            )
        self._num_allocated_bytes = offset + num_tensor_bytes
        buffer = self._backend.as_tensor(self._region)  # [region.num_bytes] uint8
        return buffer[offset : offset + num_tensor_bytes].view(dtype).view(shape)

    def reset(self) -> None:
        """Forget every allocation; tensors handed out before alias the ones handed out next."""
        self._num_allocated_bytes = 0

    def zero_(self) -> None:
        """Fill the whole pool with zeros and make its memory resident (in bulk on CPU)."""
        assert self.is_mapped, f"pool {self.tag!r} is not mapped"
        self._backend.zero(self._region)

    def as_bytes(self) -> torch.Tensor:
        """The whole capacity as one uint8 tensor of `num_bytes` elements."""
        return self._backend.as_tensor(self._region)[: self.num_bytes]

    @property
    def region(self) -> Region:
        return self._region

    def __repr__(self) -> str:
        return (
            f"MemoryPool(tag={self.tag!r}, num_bytes={self.num_bytes}, "
            f"allocated={self._num_allocated_bytes}, mapped={self.is_mapped})"
        )
