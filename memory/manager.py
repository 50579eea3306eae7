"""Tagged memory pools and their sleep/wake state machine."""

import contextlib
import dataclasses
import enum
import threading
from typing import Any, Self

import torch

from memory.backend import HostBackup, create_backend
from memory.errors import MemoryStateError, UnknownTagError
from memory.event_log import MemoryEventLog
from memory.pool import MemoryPool
from memory.process_memory import process_rss_bytes


class TagState(enum.Enum):
    """Whether a tag's contents can be used, are kept in a host backup, or are lost."""

    AWAKE = "awake"
    OFFLOADED = "offloaded"
    DISCARDED = "discarded"


@dataclasses.dataclass(eq=False)
class _TagEntry:
    pool: MemoryPool
    state: TagState
    backup: HostBackup | None = None
    spare_backup: HostBackup | None = None
    """A restored backup kept for the next sleep (backends that keep host backups)."""


class MemoryManager:
    """Owns one pool per tag; releases and re-acquires their memory at the same addresses.

    States: AWAKE (mapped, contents valid), OFFLOADED (unmapped, contents in a host backup),
    DISCARDED (contents lost; mapped or not). `wake` maps a tag again; a DISCARDED tag stays
    DISCARDED until its owner fills it and calls `mark_valid`.
    """

    def __init__(
        self, device: torch.device | str = "cpu", event_log: MemoryEventLog | None = None
    ) -> None:
        self._backend = create_backend(device)
        self.device = self._backend.device
        self.event_log = event_log
        self._entries: dict[str, _TagEntry] = {}
        self._lock = threading.RLock()
        self._is_closed = False

    # -- pools -------------------------------------------------------------------------------

    def create_pool(self, tag: str, num_bytes: int) -> MemoryPool:
        """Reserve and map a pool of `num_bytes` for `tag`; it starts AWAKE."""
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
            raise ValueError(f"num_bytes must be a positive int, got {num_bytes!r}")
        with self._lock:
            self._check_open()
            if tag in self._entries:
                raise MemoryStateError(
                    f"memory tag {tag!r} already has a pool of {self._entries[tag].pool.num_bytes}"
                    f" bytes; call free_pool({tag!r}) first or pick another tag"
                )
            with self._span("create_pool", tag=tag, num_bytes=num_bytes):
                region = self._backend.reserve(num_bytes)
                try:
                    self._backend.map(region)
                    self._backend.as_tensor(region)  # built while mapped, reused for all views
                except BaseException:
                    self._backend.free(region)
                    raise
            pool = MemoryPool(tag, num_bytes, self._backend, region)
            self._entries[tag] = _TagEntry(pool, TagState.AWAKE)
            return pool

    def free_pool(self, tag: str) -> None:
        """Give a pool's memory and address range back; its tensors must not be used after."""
        with self._lock:
            entry = self._entry(tag)
            with self._span("free_pool", tag=tag, num_bytes=entry.pool.num_bytes):
                self._close_backup(entry, keep_spare=False)
                self._backend.free(entry.pool.region)
            del self._entries[tag]

    def pool(self, tag: str) -> MemoryPool:
        return self._entry(tag).pool

    def tags(self) -> list[str]:
        """Tags in the order their pools were created."""
        with self._lock:
            return list(self._entries)

    def state(self, tag: str) -> TagState:
        return self._entry(tag).state

    def is_mapped(self, tag: str) -> bool:
        return self._entry(tag).pool.is_mapped

    # -- transitions -------------------------------------------------------------------------

    def sleep(self, tag: str, *, offload: bool) -> None:
        """Release a tag's memory: AWAKE -> OFFLOADED (offload) or DISCARDED.

        A tag already released is left as it is. A mapped DISCARDED tag is released and stays
        DISCARDED: there is nothing valid to offload.
        """
        with self._lock:
            entry = self._entry(tag)
            if not entry.pool.is_mapped:
                return
            keep = offload and entry.state is TagState.AWAKE
            region = entry.pool.region
            with self._span("sleep", tag=tag, num_bytes=entry.pool.num_bytes, offload=keep):
                backup = None
                if keep:
                    spare, entry.spare_backup = entry.spare_backup, None
                    backup = self._backend.backup(region, reuse=spare)
                try:
                    self._backend.unmap(region)
                except BaseException:
                    if backup is not None:
                        backup.close()
                    raise
            entry.backup = backup
            entry.state = TagState.OFFLOADED if keep else TagState.DISCARDED

    def wake(self, tag: str) -> None:
        """Map a released tag again at the same address.

        OFFLOADED -> AWAKE with contents restored and the backup freed. DISCARDED stays
        DISCARDED (zeroed memory on CPU, undefined on CUDA) until `mark_valid(tag)`.
        A mapped tag is left as it is.
        """
        with self._lock:
            entry = self._entry(tag)
            if entry.pool.is_mapped:
                return
            region = entry.pool.region
            with self._span(
                "wake",
                tag=tag,
                num_bytes=entry.pool.num_bytes,
                restore=entry.state is TagState.OFFLOADED,
            ):
                self._backend.map(region)
                if entry.state is TagState.OFFLOADED:
                    self._restore(entry)

    def _restore(self, entry: _TagEntry) -> None:
        assert entry.backup is not None, f"offloaded tag {entry.pool.tag!r} has no backup"
        try:
            self._backend.restore(entry.pool.region, entry.backup)
        except BaseException:
            self._backend.unmap(entry.pool.region)  # stay OFFLOADED, backup kept
            raise
        self._close_backup(entry)
        entry.state = TagState.AWAKE

    def mark_valid(self, tag: str) -> None:
        """Declare a mapped DISCARDED tag's contents valid again (after its owner refilled it)."""
        with self._lock:
            entry = self._entry(tag)
            if entry.state is TagState.AWAKE:
                return
            if not entry.pool.is_mapped:
                raise MemoryStateError(
                    f"memory tag {tag!r} is {entry.state.value} and not mapped; "
                    f"call wake({tag!r}) and fill it before mark_valid({tag!r})"
                )
            assert entry.state is TagState.DISCARDED, entry.state
            entry.state = TagState.AWAKE
            self._record("mark_valid", tag=tag)

    def mark_invalid(self, tag: str) -> None:
        """Declare a tag's contents invalid (e.g. a weight update cut off halfway).

        AWAKE -> DISCARDED, still mapped. An OFFLOADED tag drops its backup -> DISCARDED.
        """
        with self._lock:
            entry = self._entry(tag)
            if entry.state is TagState.DISCARDED:
                return
            self._close_backup(entry)
            entry.state = TagState.DISCARDED
            self._record("mark_invalid", tag=tag)

    # -- accounting and lifetime -------------------------------------------------------------

    def memory_state(self) -> dict[str, Any]:
        """{"device", "tags": {tag: {"state", "mapped", "bytes", ...}}, "process_rss_bytes"},
        plus "device_used_bytes" / "device_total_bytes" on CUDA."""
        with self._lock:
            tags = {tag: self._tag_summary(entry) for tag, entry in self._entries.items()}
        return {
            "device": str(self.device),
            "tags": tags,
            "process_rss_bytes": process_rss_bytes(),
            **self._backend.device_memory_bytes(),
        }

    @staticmethod
    def _tag_summary(entry: _TagEntry) -> dict[str, Any]:
        return {
            "state": entry.state.value,
            "mapped": entry.pool.is_mapped,
            "bytes": entry.pool.num_bytes,
            "allocated_bytes": entry.pool.num_allocated_bytes,
            "backup_bytes": 0 if entry.backup is None else entry.backup.num_bytes,
            "spare_backup_bytes": 0 if entry.spare_backup is None else entry.spare_backup.num_bytes,
        }

    def close(self) -> None:
        """Free every pool and backup; the manager cannot be used afterwards."""
        with self._lock:
            if self._is_closed:
                return
            for tag in list(self._entries):
                self.free_pool(tag)
            self._backend.close()
            self._is_closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------

    def _entry(self, tag: str) -> _TagEntry:
        with self._lock:
            self._check_open()
            entry = self._entries.get(tag)
            if entry is None:
                raise UnknownTagError(
                    f"unknown memory tag {tag!r}; known tags: {sorted(self._entries)}"
                )
            return entry

    def _check_open(self) -> None:
        if self._is_closed:
            raise MemoryStateError("the memory manager is closed; create a new MemoryManager")

    def _close_backup(self, entry: _TagEntry, keep_spare: bool = True) -> None:
        """Drop the tag's backup; backends that keep host backups keep it as the spare for
        the next sleep (pinned host memory is slow to allocate), unless `keep_spare` is off."""
        backup, entry.backup = entry.backup, None
        if backup is not None and keep_spare and self._backend.keeps_host_backups:
            if entry.spare_backup is not None:
                entry.spare_backup.close()
            entry.spare_backup = backup
        elif backup is not None:
            backup.close()
        if not keep_spare and entry.spare_backup is not None:
            entry.spare_backup.close()
            entry.spare_backup = None

    def _span(self, event: str, **fields: Any) -> contextlib.AbstractContextManager[None]:
        if self.event_log is None:
            return contextlib.nullcontext()
        return self.event_log.span(event, **fields)

    def _record(self, event: str, **fields: Any) -> None:
        if self.event_log is not None:
            self.event_log.record(event, **fields)
