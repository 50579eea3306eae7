"""CPU backend: one anonymous mmap per region, released with madvise(MADV_DONTNEED)."""

import dataclasses
import mmap

import torch

from memory.backend import HostBackup, MemoryBackend, Region

_PAGE_SIZE_BYTES = mmap.PAGESIZE
# Pre-faulting a backup in one call is much cheaper than one page fault per page.
_BACKUP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


@dataclasses.dataclass(eq=False)
class CpuRegion(Region):
    """A region backed by its own anonymous mapping."""

    mm: mmap.mmap | None = None
    tensor: torch.Tensor | None = None  # [num_bytes] uint8 over `mm`


class CpuHostBackup(HostBackup):
    """A backup in a separate anonymous mapping, unmapped (not cached) when closed."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._mm: mmap.mmap | None = mmap.mmap(-1, num_bytes, flags=_BACKUP_FLAGS)

    def as_tensor(self) -> torch.Tensor:
        assert self._mm is not None, "backup used after close()"
        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class CpuBackend(MemoryBackend):
    """Anonymous private mappings: releasing drops resident pages, the address stays."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def reserve(self, num_bytes: int) -> CpuRegion:
        num_bytes = -(-num_bytes // _PAGE_SIZE_BYTES) * _PAGE_SIZE_BYTES
        mm = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        tensor = torch.frombuffer(mm, dtype=torch.uint8)  # [num_bytes]
        return CpuRegion(base_ptr=tensor.data_ptr(), num_bytes=num_bytes, mm=mm, tensor=tensor)

    def map(self, region: Region) -> None:
        # Pages of an anonymous mapping come back zero-filled on first touch.
        region.is_mapped = True

    def unmap(self, region: Region) -> None:
        assert isinstance(region, CpuRegion) and region.mm is not None
        region.mm.madvise(mmap.MADV_DONTNEED)
        region.is_mapped = False

    def as_tensor(self, region: Region) -> torch.Tensor:
        assert isinstance(region, CpuRegion) and region.tensor is not None
        return region.tensor

    def backup(self, region: Region) -> CpuHostBackup:
        backup = CpuHostBackup(region.num_bytes)
        backup.as_tensor().copy_(self.as_tensor(region))
        return backup

    def restore(self, region: Region, backup: HostBackup) -> None:
        assert isinstance(backup, CpuHostBackup) and backup.num_bytes == region.num_bytes
        self.as_tensor(region).copy_(backup.as_tensor())
        backup.close()

    def free(self, region: Region) -> None:
        assert isinstance(region, CpuRegion) and region.mm is not None
        self.unmap(region)
        mm, region.mm, region.tensor = region.mm, None, None
        try:
            mm.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes away with the last one
