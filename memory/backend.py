"""The interface a memory backend implements, and the choice of backend from a device."""

import abc
import dataclasses

import torch

from memory.errors import BackendUnavailableError


@dataclasses.dataclass(eq=False)
class Region:
    """A reserved address range whose physical memory can be released and re-acquired."""

    base_ptr: int
    """First address of the range; never changes while the region exists."""
    num_bytes: int
    """Size of the range, the asked size rounded up to the backend's granularity."""
    is_mapped: bool = False
    """Whether physical memory currently backs the range."""


class HostBackup(abc.ABC):
    """A copy of a region's bytes in host memory, freed by `close()`."""

    num_bytes: int

    @abc.abstractmethod
    def close(self) -> None:
        """Free the host memory; calling it twice is harmless."""


class MemoryBackend(abc.ABC):
    """Reserves address ranges once and maps/unmaps physical memory behind them."""

    device: torch.device

    @abc.abstractmethod
    def reserve(self, num_bytes: int) -> Region:
        """Reserve an address range of at least `num_bytes`; it starts unmapped."""

    @abc.abstractmethod
    def map(self, region: Region) -> None:
        """Back the range with physical memory; its content is undefined (zero on CPU)."""

    @abc.abstractmethod
    def unmap(self, region: Region) -> None:
        """Give the physical memory back; the address range stays reserved."""

    @abc.abstractmethod
    def as_tensor(self, region: Region) -> torch.Tensor:
        """A uint8 tensor over the whole range, valid for the region's lifetime."""

    def zero(self, region: Region) -> None:
        """Fill the mapped range with zeros; afterwards all of it is resident."""
        self.as_tensor(region).zero_()

    keeps_host_backups: bool = False
    """Whether the manager keeps a restored backup for the next sleep instead of freeing it."""

    @abc.abstractmethod
    def backup(self, region: Region, reuse: HostBackup | None = None) -> HostBackup:
        """Copy the mapped range into host memory: `reuse` if it fits (else it is freed),
        new memory otherwise."""

    @abc.abstractmethod
    def restore(self, region: Region, backup: HostBackup) -> None:
        """Copy a backup into the mapped range; the caller frees or keeps the backup."""

    @abc.abstractmethod
    def free(self, region: Region) -> None:
        """Unmap if needed and give the address range back."""

    def device_memory_bytes(self) -> dict[str, int]:
        """Used/total bytes of the device, for backends that have one."""
        return {}

    def close(self) -> None:
        """Release what the backend itself holds, after every region is freed."""


def create_backend(device: torch.device | str) -> MemoryBackend:
    """The backend for `device`: an anonymous mmap on CPU, CUDA virtual memory on CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        from memory.cpu_backend import CpuBackend

        return CpuBackend()
    if device.type == "cuda":
        from memory.cuda_backend import CudaBackend

        return CudaBackend(device)
    raise BackendUnavailableError(
        f"no memory backend for device type {device.type!r}; use 'cpu' or 'cuda'"
    )
