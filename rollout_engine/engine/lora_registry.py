"""The engine's LoRA adapters, by the names and ids requests give them (vLLM's `add_lora`,
`remove_lora`, `list_loras`).

Each adapter loaded gets an engine-wide id of its own (`lora_id`, never reused): requests
carry it to the scheduler (at most `max_loras` of them run at once; their prefix-cache entries
are the adapter's) and to the worker (which slot holds its weights). An adapter removed, or
dropped from host memory and read again, comes back under a new id, so no KV computed under
other weights is ever served from the prefix cache.

An adapter can be replaced under its name and id (`load_inplace`, vLLM's name): the new
weights are read and checked whole first (if anything is refused, the old adapter serves on),
then new requests get them, while requests that started under the old ones finish under them;
the old weights are dropped once none runs.

Host memory holds at most `max_cpu_loras` adapters read from a path: past that, the least
recently used one no request runs under is dropped, and read again from its path when a
request next names it. Adapters pushed as tensors have no path to be read from: they stay
until removed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_engine.config import LoRAConfig
from rollout_engine.protocol import LoadedLoRA, LoRAError, LoRARequest
from rollout_engine.worker.lora.adapter import load_peft_adapter


@dataclass
class _Adapter:
    request: LoRARequest
    lora_id: int
    """Its engine-wide id while loaded (0: dropped from host memory, read again when asked)."""


class LoRARegistry:
    def __init__(self, config: LoRAConfig, worker, lora_ids_in_use: Callable[[], Iterable[int]]
                 ) -> None:
        self.config = config
        self.worker = worker
        self._lora_ids_in_use = lora_ids_in_use
        """The adapter ids unfinished requests run under (the scheduler's)."""
        self._adapters: OrderedDict[int, _Adapter] = OrderedDict()
        """By `lora_int_id`, least recently asked for first."""
        self._next_id = itertools.count(1)
        self._retired: set[int] = set()
        """Ids of adapters removed or replaced in place whose requests still run (dropped from
        the worker once none does)."""

    def add(self, request: LoRARequest, peft_config: Mapping[str, Any] | None = None,
            tensors: Mapping[str, Any] | None = None, load_inplace: bool = False) -> bool:
        """Load an adapter from its path (or from `peft_config` and `tensors`, given both).
        False if this very adapter is loaded already (unless `load_inplace`: then it is read
        again); LoRAError, changing nothing, if refused. `load_inplace` replaces the adapter
        of this name and id (see the module doc)."""
        self._check_enabled()
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"expected a LoRARequest, got {type(request).__name__}")
        self._drop_retired()
        old = self._adapters.get(request.lora_int_id)
        for other in self._adapters.values():
            if other.request.lora_name == request.lora_name and other is not old:
                raise LoRAError(f"lora_name {request.lora_name!r} is in use by lora_int_id "
                                f"{other.request.lora_int_id}; remove it first")
        if old is not None and old.request.lora_name != request.lora_name:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is in use by "
                            f"{old.request.lora_name!r}; remove it first")
        if old is not None and not load_inplace:
            if old.request != request:
                raise LoRAError(f"LoRA adapter {request.lora_name!r} is in use with another "
                                "path; remove it first, or load it in place")
            return False
        if (peft_config is None) != (tensors is None):
            raise LoRAError("pass both peft_config and tensors, or neither (read lora_path)")
        if peft_config is None and not request.lora_path:
            raise LoRAError(f"adapter {request.lora_name!r} has no lora_path and no tensors")
        adapter = _Adapter(request, 0)
        self._load(adapter, peft_config, tensors)  # the old one serves on if this raises
        if old is not None and old.lora_id:
            self._retired.add(old.lora_id)
        self._adapters[request.lora_int_id] = adapter
        self._adapters.move_to_end(request.lora_int_id)
        self._drop_retired()
        self._drop_idle()
        return True

    def check(self, peft_config: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
        """LoRAError if an adapter of this config and these tensors (meta tensors will do:
        names, shapes, dtypes) would be refused."""
        self._check_enabled()
        self.worker.check_lora(peft_config, tensors)

    def add_named(self, lora_name: str, lora_path: str = "",
                  peft_config: Mapping[str, Any] | None = None,
                  tensors: Mapping[str, Any] | None = None, load_inplace: bool = False) -> bool:
        """`add` by name alone (HTTP, gRPC): the id is the adapter's of that name, or a new one."""
        known = self.by_name(lora_name)
        lora_int_id = known.lora_int_id if known is not None else max(self._adapters, default=0) + 1
        return self.add(LoRARequest(lora_name, lora_int_id, lora_path), peft_config, tensors,
                        load_inplace)

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter; False if none has this id. New requests can no longer name it;
        requests running under it finish under it (its weights go once none runs)."""
        self._check_enabled()
        adapter = self._adapters.pop(lora_int_id, None)
        if adapter is None:
            return False
        if adapter.lora_id:
            self._retired.add(adapter.lora_id)
        self._drop_retired()
        return True

    def list(self) -> list[LoRARequest]:
        return [adapter.request for adapter in self._adapters.values()]

    def resolve(self, request: LoRARequest | None) -> int:
        """The id a new request under this adapter runs with (0 for None: the base model),
        loading the adapter first if it is not loaded (vLLM loads on first use)."""
        if request is None:
            return 0
        self._check_enabled()
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is None or adapter.request != request:
            self.add(request)  # refuses a clash of ids or names
            adapter = self._adapters[request.lora_int_id]
        if not adapter.lora_id:
            self._load(adapter, None, None)
        self._adapters.move_to_end(request.lora_int_id)
        lora_id = adapter.lora_id
        self._drop_idle(keep=lora_id)
        return lora_id

    def by_name(self, lora_name: str) -> LoRARequest | None:
        return next((a.request for a in self._adapters.values()
                     if a.request.lora_name == lora_name), None)

    def loaded(self) -> list[LoadedLoRA]:
        """The adapters with the load each serves from (what servers report)."""
        return [LoadedLoRA(a.request.lora_name, a.request.lora_int_id, a.request.lora_path,
                           a.lora_id) for a in self._adapters.values()]

    def loaded_by_name(self, lora_name: str) -> LoadedLoRA | None:
        return next((a for a in self.loaded() if a.lora_name == lora_name), None)

    def _load(self, adapter: _Adapter, peft_config, tensors) -> None:
        if peft_config is None:
            peft_config, tensors = load_peft_adapter(adapter.request.lora_path)
        lora_id = next(self._next_id)
        self.worker.add_lora(lora_id, peft_config, tensors)
        adapter.lora_id = lora_id

    def _drop_retired(self) -> None:
        if self._retired:
            idle = self._retired - set(self._lora_ids_in_use())
            for lora_id in idle:
                self.worker.remove_lora(lora_id)
            self._retired -= idle

    def _drop_idle(self, keep: int = 0) -> None:
        """Drop host copies past `max_cpu_loras`: least recently asked for first, only those
        with a path to read them from again, never one that requests run under."""
        loaded = [a for a in self._adapters.values() if a.lora_id]
        excess = len(loaded) - self.config.num_cpu_loras
        if excess <= 0:
            return
        in_use = set(self._lora_ids_in_use()) | {keep}
        for adapter in loaded:
            if excess == 0:
                break
            if adapter.request.lora_path and adapter.lora_id not in in_use:
                self.worker.remove_lora(adapter.lora_id)
                adapter.lora_id = 0
                excess -= 1

    def _check_enabled(self) -> None:
        if not self.config.enable_lora:
            raise LoRAError("LoRA is not enabled on this engine; start it with enable_lora=True")
