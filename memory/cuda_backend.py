"""CUDA backend: virtual address ranges reserved once, physical memory mapped on demand.

Uses the driver's virtual memory management (cuMemAddressReserve / cuMemCreate / cuMemMap /
cuMemUnmap / cuMemRelease) through cuda-bindings, imported only when this backend is built.
"""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from memory.backend import HostBackup, MemoryBackend, Region
from memory.cuda_driver import call, load_driver
from memory.errors import BackendUnavailableError
from memory.process_memory import cuda_device_memory_bytes


@dataclasses.dataclass(eq=False)
class CudaRegion(Region):
    """A reserved device address range; `handle` is its physical allocation while mapped."""

    handle: Any = None  # CUmemGenericAllocationHandle
    tensor: torch.Tensor | None = None  # [num_bytes] uint8, built at the first map


class _CudaArrayView:
    """Presents a device address range to `torch.as_tensor` as a uint8 array."""

    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


def _wrap_with_cupy(
    ptr: int, num_bytes: int, device: torch.device, cause: BaseException
) -> torch.Tensor:
    try:
        import cupy
    except ImportError:
        raise RuntimeError(
            f"torch could not view device memory at {ptr:#x} ({cause}); "
            "installing cupy gives a DLPack fallback"
        ) from cause
    with cupy.cuda.Device(device.index):
        memory = cupy.cuda.UnownedMemory(ptr, num_bytes, owner=None, device_id=device.index)
        array = cupy.ndarray(
            (num_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
        )
    return torch.from_dlpack(array)


class CudaHostBackup(HostBackup):
    """Page-locked host memory of exactly the region's size, freed when closed.

    Allocated with cuMemHostAlloc rather than torch's pinned allocator, which rounds sizes
    up to a power of two and keeps freed blocks cached in the process.
    """

    def __init__(self, backend: "CudaBackend", num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._backend = backend
        with backend.context():
            self.host_ptr: int | None = int(
                call("cuMemHostAlloc", num_bytes, 0, detail=f"pinning {num_bytes} host bytes")
            )

    def close(self) -> None:
        if self.host_ptr is not None:
            with self._backend.context():
                call("cuMemFreeHost", self.host_ptr)
            self.host_ptr = None


class CudaBackend(MemoryBackend):
    """One device's virtual memory: a reservation per region, a physical handle per map.

    Pinned host backups are kept across sleep cycles: allocating and freeing a model-sized
    page-locked buffer on every sleep(level=1) dominated wake time in torch_memory_saver.
    """

    keeps_host_backups = True

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"device {str(device)!r} needs CUDA, but torch.cuda.is_available() is False "
                "(no GPU, no driver, or a CPU build of torch); use device='cpu'"
            )
        driver = load_driver()
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        torch.cuda.init()
        call("cuInit", 0)
        self._cu_device = call("cuDeviceGet", index)
        vmm = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED
        if not call("cuDeviceGetAttribute", vmm, self._cu_device):
            raise BackendUnavailableError(
                f"{self.device} does not support virtual memory management"
            )
        # The primary context is the one torch's runtime calls use too.
        self._context = call("cuDevicePrimaryCtxRetain", self._cu_device)
        self._prop = self._allocation_prop(driver, index)
        self._access = self._access_desc(driver, index)
        minimum = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity_bytes = int(call("cuMemGetAllocationGranularity", self._prop, minimum))

    @staticmethod
    def _allocation_prop(driver: Any, index: int) -> Any:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        return prop

    @staticmethod
    def _access_desc(driver: Any, index: int) -> Any:
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return access

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Make this device's primary context current on the calling thread for a while."""
        if int(call("cuCtxGetCurrent")) == int(self._context):
            yield
            return
        call("cuCtxPushCurrent", self._context)
        try:
            yield
        finally:
            call("cuCtxPopCurrent")

    def reserve(self, num_bytes: int) -> CudaRegion:
        num_bytes = -(-num_bytes // self.granularity_bytes) * self.granularity_bytes
        with self.context():
            ptr = call(
                "cuMemAddressReserve",
                num_bytes,
                self.granularity_bytes,
                0,
                0,
                detail=f"reserving {num_bytes} bytes of address space",
            )
        return CudaRegion(base_ptr=int(ptr), num_bytes=num_bytes)

    def map(self, region: Region) -> None:
        assert isinstance(region, CudaRegion) and not region.is_mapped
        size, ptr = region.num_bytes, region.base_ptr
        with self.context():
            handle = call(
                "cuMemCreate",
                size,
                self._prop,
                0,
                detail=f"allocating {size} bytes on {self.device}",
            )
            try:
                call("cuMemMap", ptr, size, 0, handle, 0)
            except Exception:
                call("cuMemRelease", handle)
                raise
            try:
                call("cuMemSetAccess", ptr, size, [self._access], 1)
            except Exception:
                call("cuMemUnmap", ptr, size)
                call("cuMemRelease", handle)
                raise
        region.handle, region.is_mapped = handle, True

    def unmap(self, region: Region) -> None:
        assert isinstance(region, CudaRegion) and region.is_mapped
        # Kernels still queued on any stream may read or write the range.
        torch.cuda.synchronize(self.device)
        with self.context():
            call("cuMemUnmap", region.base_ptr, region.num_bytes)
            call("cuMemRelease", region.handle)
        region.handle, region.is_mapped = None, False

    def as_tensor(self, region: Region) -> torch.Tensor:
        assert isinstance(region, CudaRegion)
        if region.tensor is None:
            assert region.is_mapped, "the first tensor over a region must be built while mapped"
            region.tensor = self._wrap(region.base_ptr, region.num_bytes)  # [num_bytes] uint8
        return region.tensor

    def _wrap(self, ptr: int, num_bytes: int) -> torch.Tensor:
        """A torch view of device memory: __cuda_array_interface__, else cupy + DLPack."""
        try:
            # With an explicit device torch wraps the pointer; without one it would copy.
            tensor = torch.as_tensor(_CudaArrayView(ptr, num_bytes), device=self.device)
        except (RuntimeError, TypeError) as error:
            tensor = _wrap_with_cupy(ptr, num_bytes, self.device, error)
        if tensor.data_ptr() != ptr or tensor.device != self.device:
            raise RuntimeError(
                f"wrapping {ptr:#x} on {self.device} gave a tensor at {tensor.data_ptr():#x} "
                f"on {tensor.device}; pool memory must be viewed, never copied"
            )
        return tensor

    def backup(self, region: Region, reuse: HostBackup | None = None) -> CudaHostBackup:
        assert region.is_mapped
        fits = (isinstance(reuse, CudaHostBackup) and reuse.num_bytes == region.num_bytes
                and reuse.host_ptr is not None)
        if reuse is not None and not fits:
            reuse.close()
        backup = reuse if fits else CudaHostBackup(self, region.num_bytes)
        torch.cuda.synchronize(self.device)
        try:
            with self.context():
                call("cuMemcpyDtoH", backup.host_ptr, region.base_ptr, region.num_bytes)
        except Exception:
            backup.close()
            raise
        return backup

    def restore(self, region: Region, backup: HostBackup) -> None:
        assert isinstance(backup, CudaHostBackup) and backup.num_bytes == region.num_bytes
        assert region.is_mapped and backup.host_ptr is not None
        torch.cuda.synchronize(self.device)
        with self.context():
            call("cuMemcpyHtoD", region.base_ptr, backup.host_ptr, region.num_bytes)

    def free(self, region: Region) -> None:
        assert isinstance(region, CudaRegion)
        if region.is_mapped:
            self.unmap(region)
        region.tensor = None
        with self.context():
            call("cuMemAddressFree", region.base_ptr, region.num_bytes)

    def device_memory_bytes(self) -> dict[str, int]:
        return cuda_device_memory_bytes(self.device)

    def close(self) -> None:
        if self._context is not None:
            call("cuDevicePrimaryCtxRelease", self._cu_device)
            self._context = None
