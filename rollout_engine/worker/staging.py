"""Moves a step's host-built arrays to the device in one copy from pinned memory.

A pageable host-to-device copy makes the host wait for the device, so a step that uploads
its token ids, positions, slot mapping, block tables and sampling parameters one tensor
at a time waits several times. `HostStaging` packs all of a step's arrays into one pinned
buffer and issues a single asynchronous copy; the device tensors are views into one device
buffer. On the CPU there is nothing to move: the arrays are wrapped without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every array starts aligned for any dtype it may be viewed as


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


class _Slot:
    """One pinned host buffer, its device twin, and the event of its last copy."""

    def __init__(self, device: torch.device, num_bytes: int) -> None:
        pin = device.type == "cuda"
        self.host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
        self.device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.copied: torch.cuda.Event | None = None

    @property
    def num_bytes(self) -> int:
        return self.host.numel()


class HostStaging:
    """`upload(arrays)` returns device tensors with the arrays' dtypes and shapes.

    Slots are used in turn (`num_slots`, 2 by default, so the host can fill step N+1's
    while step N's copy is in flight); before a slot's host buffer is written again, the
    host waits for that slot's previous copy, which long finished in practice.
    """

    def __init__(
        self, device: torch.device | str, num_slots: int = 2, pack: bool | None = None
    ) -> None:
        self.device = torch.device(device)
        self.pack = self.device.type != "cpu" if pack is None else pack
        """Pack and copy (always off the CPU; tests turn it on for the CPU)."""
        self.num_slots = num_slots
        self._slots: list[_Slot | None] = [None] * num_slots
        self._next = 0
        self.num_copies = 0
        """Host-to-device copies issued so far (one per upload on an accelerator)."""

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        if not self.pack:
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        # Arrays of one dtype sit together, so each dtype needs one view of the buffer.
        by_dtype: dict[np.dtype, list[tuple[str, np.ndarray]]] = {}
        for name, array in arrays.items():
            by_dtype.setdefault(array.dtype, []).append((name, np.ascontiguousarray(array)))
        layout, total = [], 0  # (dtype, [(name, array, element offset)], byte offset)
        for dtype, members in by_dtype.items():
            placed, num_elements = [], 0
            for name, array in members:
                placed.append((name, array, num_elements))
                num_elements += array.size
            layout.append((dtype, placed, total, num_elements))
            total += _aligned(num_elements * dtype.itemsize)
        slot = self._slot(max(total, _ALIGN))
        host = slot.host.numpy()
        for dtype, placed, byte_offset, num_elements in layout:
            region = host[byte_offset : byte_offset + num_elements * dtype.itemsize].view(dtype)
            for _, array, offset in placed:
                region[offset : offset + array.size] = array.reshape(-1)
        slot.device[:total].copy_(slot.host[:total], non_blocking=True)
        if self.device.type == "cuda":
            slot.copied = torch.cuda.Event()
            slot.copied.record()
        self.num_copies += 1
        tensors = {}
        for dtype, placed, byte_offset, num_elements in layout:
            torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
            region = slot.device[byte_offset : byte_offset + num_elements * dtype.itemsize]
            views = region.view(torch_dtype).split([array.size for _, array, _ in placed])
            for (name, array, _), flat in zip(placed, views):
                tensors[name] = flat if array.ndim == 1 else flat.view(array.shape)
        return tensors

    def _slot(self, num_bytes: int) -> _Slot:
        index = self._next
        self._next = (self._next + 1) % self.num_slots
        slot = self._slots[index]
        if slot is not None and slot.copied is not None:
            slot.copied.synchronize()  # its previous copy must have left the host buffer
        if slot is None or slot.num_bytes < num_bytes:
            size = max(num_bytes, 2 * (slot.num_bytes if slot else 0), 1 << 16)
            slot = self._slots[index] = _Slot(self.device, size)
        return slot
