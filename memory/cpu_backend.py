"""CPU backend: one anonymous mmap per region, released with madvise(MADV_DONTNEED)."""

import contextlib
import dataclasses
import mmap

import torch

from memory.backend import HostBackup, MemoryBackend, Region

_PAGE_SIZE_BYTES = mmap.PAGESIZE
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
# Linux >= 5.14; Python only names it from 3.13 on.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _new_mapping(num_bytes: int, populate: bool) -> mmap.mmap:
    """An anonymous mapping on transparent huge pages where the kernel allows them.

    Huge pages make release and re-population work 2 MiB at a time, not 4 KiB; populating
    in one call (`populate`) is much cheaper than one page fault per page.
    """
    mm = mmap.mmap(-1, num_bytes, flags=_FLAGS)
    with contextlib.suppress(OSError, AttributeError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    if populate:
        with contextlib.suppress(OSError):  # a kernel older than 5.14 faults pages on touch
            mm.madvise(_MADV_POPULATE_WRITE)
    return mm


@dataclasses.dataclass(eq=False)
class CpuRegion(Region):
    """A region backed by its own anonymous mapping."""

    mm: mmap.mmap | None = None
    tensor: torch.Tensor | None = None  # [num_bytes] uint8 over `mm`


class CpuHostBackup(HostBackup):
    """A backup in a separate anonymous mapping, unmapped (not cached) when closed."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._mm: mmap.mmap | None = _new_mapping(num_bytes, populate=True)

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
        mm = _new_mapping(num_bytes, populate=False)
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

    def zero(self, region: Region) -> None:
        # Dropped pages come back zero-filled; populating them in one call avoids a fault per page.
        assert isinstance(region, CpuRegion) and region.mm is not None
        region.mm.madvise(mmap.MADV_DONTNEED)
        try:
            region.mm.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # a kernel older than 5.14: touch every page instead
            super().zero(region)

    def backup(self, region: Region, reuse: HostBackup | None = None) -> CpuHostBackup:
        if isinstance(reuse, CpuHostBackup) and reuse.num_bytes == region.num_bytes:
            backup = reuse
        else:
            if reuse is not None:
                reuse.close()
            backup = CpuHostBackup(region.num_bytes)
        backup.as_tensor().copy_(self.as_tensor(region))
        return backup

    def restore(self, region: Region, backup: HostBackup) -> None:
        assert isinstance(backup, CpuHostBackup) and backup.num_bytes == region.num_bytes
        self.as_tensor(region).copy_(backup.as_tensor())

    def free(self, region: Region) -> None:
        assert isinstance(region, CpuRegion) and region.mm is not None
        self.unmap(region)
        mm, region.mm, region.tensor = region.mm, None, None
        try:
            mm.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes away with the last one
