"""Tagged memory pools whose physical memory can be released and re-acquired at the same address."""

from memory.backend import HostBackup, MemoryBackend, Region, create_backend
from memory.errors import (
    BackendUnavailableError,
    CudaDriverError,
    MemoryStateError,
    PoolCapacityError,
    UnknownTagError,
)
from memory.event_log import MemoryEventLog
from memory.manager import MemoryManager, TagState
from memory.pool import ALIGNMENT_BYTES, MemoryPool
from memory.process_memory import cuda_device_memory_bytes, process_rss_bytes

__all__ = [
    "ALIGNMENT_BYTES",
    "BackendUnavailableError",
    "CudaDriverError",
    "HostBackup",
    "MemoryBackend",
    "MemoryEventLog",
    "MemoryManager",
    "MemoryPool",
    "MemoryStateError",
    "PoolCapacityError",
    "Region",
    "TagState",
    "UnknownTagError",
    "create_backend",
    "cuda_device_memory_bytes",
    "process_rss_bytes",
]
