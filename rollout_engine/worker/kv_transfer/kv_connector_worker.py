"""Prefill–decode disaggregation, the worker's half of the KV connector.

The prefill side copies a finished prompt's KV out of its blocks into one contiguous flat
tensor (per layer holding KV, its keys [num_tokens, num_kv_heads, key_head_dim] then its
values: for layers that agree, the memory of [num_layers, 2, num_tokens, num_kv_heads,
head_dim]), and publishes it: a /dev/shm file
("shm"), a tensor this server streams on request ("grpc", `PullKV`), or a CUDA tensor shared
by IPC handle ("cuda_ipc"). The completion carries a handle naming it. The prompt's blocks
are freed at once: the copy, not the blocks, waits for the decode engine (until the
handle's time to live runs out).

The decode side fetches a handle's KV on a background thread and writes it into the blocks
the scheduler allocated, on the engine thread, and only for a request that still waits for
it. A fetch that fails or outlives its timeout is reported as failed: the scheduler then has
the prompt computed here.

On a GPU cluster the transport to add is NIXL over RDMA, reading the prefill engine's blocks
in place (vLLM's NixlConnector); it needs the prefill to hold its blocks until read, which
the scheduler's `kv_to_save` hold already allows.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence

import torch

from memory.shm import SHM_DIR, unlink_all
from rollout_engine.config import KVTransferConfig
from rollout_engine.core.scheduler_output import KVLoad
from rollout_engine.protocol import KVTransferError, KVTransferParams
from rollout_engine.worker.kv_cache_spec import KVCacheSpec, PagedKVCache
from rollout_engine.worker.kv_transfer.kv_transports import (
    KVTransferFailed,
    cuda_ipc_location,
    fetch_shm,
    write_shm,
)

logger = logging.getLogger(__name__)

Fetch = Callable[[KVTransferParams, float], torch.Tensor]
"""(handle, deadline on time.monotonic()) -> the handle's KV tensor, on any device."""


def prompt_hash(token_ids: Sequence[int]) -> str:
    """SHA-256 of token ids: a handle's KV is only used for the prompt that computed it."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def kv_layout_key(hf_config, spec: KVCacheSpec) -> str:
    """What must be equal on both sides for KV to be interchangeable: the model's shape, the
    KV dtype and the block size (zero-copy transports read whole blocks)."""
    return json.dumps(
        {
            "architecture": (getattr(hf_config, "architectures", None) or [""])[0],
            "model_type": hf_config.model_type,
            "hidden_size": hf_config.hidden_size,
            "vocab_size": hf_config.vocab_size,
            "layers": spec.describe(),
            "dtype": str(spec.dtype).removeprefix("torch."),
            "block_size": spec.block_size,
        },
        sort_keys=True,
    )


class KVStore:
    """Prefill side: saved KV waiting for its decode engine, each entry until it is pulled
    or its time to live ends. /dev/shm files are unlinked at expiry and at exit.

    Expiry does not wait for the next save or pull: from the first save on, a daemon thread
    sleeps until the earliest entry expires (or one is added) and drops what is due, so an
    idle prefill server gives its /dev/shm back too. `close()` (or collecting the store)
    stops it.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries = _StoreEntries()
        self._finalizer = weakref.finalize(self, self._entries.close)
        self._expiry_thread: threading.Thread | None = None

    def put_tensor(self, transfer_id: str, tensor: torch.Tensor) -> None:
        with self._entries.changed:
            self._entries.tensors[transfer_id] = (tensor, time.monotonic() + self.ttl_s)
            self._on_put()

    def put_file(self, path: str) -> None:
        with self._entries.changed:
            self._entries.files[path] = time.monotonic() + self.ttl_s
            self._on_put()

    def pop(self, transfer_id: str) -> torch.Tensor | None:
        """The saved tensor, handed out once; None if unknown, pulled or expired."""
        self.expire()
        with self._entries.changed:
            entry = self._entries.tensors.pop(transfer_id, None)
        return None if entry is None else entry[0]

    def expire(self) -> None:
        self._entries.expire()

    @property
    def num_entries(self) -> int:
        with self._entries.changed:
            return len(self._entries.tensors) + len(self._entries.files)

    def close(self) -> None:
        self._finalizer()
        if self._expiry_thread is not None:
            self._expiry_thread.join(timeout=5.0)  # it only has to wake up and return

    def _on_put(self) -> None:
        """Under the lock: wake the expiry thread (its earliest expiry may have changed), or
        start it at the first save. It holds the entries, never the store."""
        if self._expiry_thread is None:
            self._expiry_thread = threading.Thread(
                target=self._entries.expire_until_closed, name="kv-store-expiry", daemon=True
            )
            self._expiry_thread.start()
        self._entries.changed.notify_all()


class _StoreEntries:
    """What a KVStore holds, shared with its expiry thread."""

    def __init__(self) -> None:
        # Reentrant: the store's finalizer (`close`) may run on a thread already holding it.
        self.changed = threading.Condition(threading.RLock())
        """Guards the entries; notified when one is added and at close."""
        self.tensors: dict[str, tuple[torch.Tensor, float]] = {}  # id -> (tensor, expiry)
        self.files: dict[str, float] = {}  # path -> expiry
        self.is_closed = False

    def expire(self) -> None:
        """Drop every entry whose expiry (time.monotonic()) has passed; unlink its file."""
        now = time.monotonic()
        with self.changed:
            for transfer_id in [t for t, (_, e) in self.tensors.items() if e <= now]:
                del self.tensors[transfer_id]
            expired = [p for p, e in self.files.items() if e <= now]
            for path in expired:
                del self.files[path]
        unlink_all(expired)

    def expire_until_closed(self) -> None:
        """The expiry thread: asleep until the earliest entry is due, an entry is added, or
        the store closes; never polling."""
        while True:
            self.expire()
            with self.changed:
                if self.is_closed:
                    return
                expiries = [e for _, e in self.tensors.values()] + list(self.files.values())
                timeout_s = max(min(expiries) - time.monotonic(), 0.0) if expiries else None
                self.changed.wait(timeout_s)

    def close(self) -> None:
        """Drop everything, unlink every file, stop the expiry thread."""
        with self.changed:
            self.is_closed = True
            self.tensors.clear()
            paths = list(self.files)
            self.files.clear()
            self.changed.notify_all()
        unlink_all(paths)


class KVTransfer:
    """Saves finished prefills' KV (prefill role) and loads handles' KV (decode role)."""

    def __init__(
        self,
        kv_caches: PagedKVCache,
        layout_key: str,
        config: KVTransferConfig,
        fetchers: dict[str, Fetch],
        weights_fingerprint: Callable[[], str],
    ) -> None:
        self.kv_caches = kv_caches
        self.spec = kv_caches.spec
        self.layout_key = layout_key
        self.config = config
        self.weights_fingerprint = weights_fingerprint
        self.device = kv_caches.device
        self.address = ""
        """Prefill side, transport "grpc": this server's address, written into handles (the
        server sets it once it listens)."""
        self.store = KVStore(config.kv_handle_ttl_s)
        self._fetchers = {"shm": fetch_shm, **fetchers}
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-fetch")
        self._loads: dict[str, tuple[concurrent.futures.Future, float]] = {}
        self._done = threading.Condition()
        self.fetch_delay_s = float(os.environ.get("ROLLOUT_ENGINE_KV_FETCH_DELAY_S", "0"))
        """Test-only: each fetch first sleeps this long (a slow peer)."""
        self.fetch_gate: threading.Event | None = None
        """Test-only: each fetch first waits for this event (until its deadline), so a test
        decides when a transfer may land, whatever the machine's speed."""
        self.num_saved = 0
        self.num_saved_bytes = 0
        self.num_loaded_bytes = 0

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    # ------------------------------------------------------------------ checks
    def check_request(
        self, params: KVTransferParams, prompt_token_ids: Sequence[int], weight_version: int
    ) -> None:
        """KVTransferError unless this engine can act on `params` for this prompt."""
        role = self.config.kv_role
        if params.do_remote_decode and role not in ("prefill", "both"):
            raise KVTransferError(
                f"this engine's kv_role is {role!r}: only a prefill engine (--kv-role prefill "
                f"or both) saves KV for a remote decode"
            )
        if not params.do_remote_prefill:
            return
        if role not in ("decode", "both"):
            raise KVTransferError(
                f"this engine's kv_role is {role!r}: only a decode engine (--kv-role decode "
                f"or both) loads KV from a handle"
            )
        if params.layout != self.layout_key:
            raise KVTransferError(
                "the handle's KV layout differs from this engine's (model, dtype or block "
                f"size); prefill: {params.layout or '?'}; decode: {self.layout_key}"
            )
        if params.weight_version != weight_version:
            raise KVTransferError(
                f"the handle's KV was computed with weight version {params.weight_version} "
                f"but this engine has version {weight_version}; push the same weights to both "
                "engines before generating, so that no completion mixes two versions"
            )
        if params.weights_fingerprint != self.weights_fingerprint():
            raise KVTransferError(
                "the handle's KV was computed with other weights than this engine's (another "
                "checkpoint, or other values at the same weight version); load the same "
                "checkpoint, or push the same weights, to both engines"
            )
        num_tokens = params.num_tokens
        if num_tokens >= len(prompt_token_ids) or (
            prompt_hash(prompt_token_ids[:num_tokens]) != params.prompt_hash
        ):
            raise KVTransferError(
                "the handle's KV was computed for another prompt; send the decode engine the "
                "prompt that was prefilled"
            )
        if params.transport not in self._fetchers:
            raise KVTransferError(f"this engine cannot fetch over {params.transport!r}")
        if params.transport == "grpc" and not (params.location or self.config.kv_peer):
            raise KVTransferError(
                "the handle names no prefill server to pull from; start the decode engine "
                "with --kv-peer ADDR"
            )

    # ------------------------------------------------------------------ prefill side
    def save(
        self, block_ids: Sequence[int], prompt_token_ids: Sequence[int], weight_version: int
    ) -> KVTransferParams | None:
        """Copy the KV of all prompt positions but the last (the decode engine computes that
        one for its logits) out of `block_ids`, publish it, and return its handle."""
        num_tokens = len(prompt_token_ids) - 1
        if num_tokens < 1:
            return None
        kv = self.gather(block_ids, num_tokens)
        transfer_id = uuid.uuid4().hex
        transport = self.config.kv_transport
        self.store.expire()
        if transport == "shm":
            location = write_shm(kv)
            self.store.put_file(os.path.join(SHM_DIR, location))
        elif transport == "grpc":
            self.store.put_tensor(transfer_id, kv.cpu())
            location = self.address
        else:
            kv = kv.contiguous()
            self.store.put_tensor(transfer_id, kv)  # alive until pulled or expired
            location = cuda_ipc_location(kv)
        self.num_saved += 1
        self.num_saved_bytes += kv.numel() * kv.element_size()
        return KVTransferParams(
            do_remote_prefill=True,
            transfer_id=transfer_id,
            transport=transport,
            location=location,
            num_tokens=num_tokens,
            prompt_hash=prompt_hash(prompt_token_ids[:num_tokens]),
            layout=self.layout_key,
            weight_version=weight_version,
            weights_fingerprint=self.weights_fingerprint(),
        )

    def gather(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """The KV of the first `num_tokens` positions as a new flat tensor on the KV cache's
        device (`PagedKVCache.read_tokens`)."""
        return self.kv_caches.read_tokens(block_ids, num_tokens)

    # ------------------------------------------------------------------ decode side
    def start(self, loads: Sequence[KVLoad]) -> None:
        """Fetch each load's KV in the background (`poll` reports them)."""
        deadline = time.monotonic() + self.config.kv_transfer_timeout_s
        for load in loads:
            future = self._pool.submit(self._fetch, load.params, deadline)
            future.add_done_callback(self._notify)
            self._loads[load.request_id] = (future, deadline)

    def poll(self) -> list[tuple[str, torch.Tensor | BaseException]]:
        """Loads that ended: (request id, the KV tensor or why it failed). A fetch past its
        deadline ends as TimeoutError; its late result is never used."""
        now, ended = time.monotonic(), []
        for request_id, (future, deadline) in list(self._loads.items()):
            if future.done():
                error = future.exception()
                ended.append((request_id, error if error is not None else future.result()))
            elif now >= deadline:
                future.cancel()
                ended.append((request_id, TimeoutError(
                    f"the KV transfer took more than {self.config.kv_transfer_timeout_s} s"
                )))
            else:
                continue
            del self._loads[request_id]
        return ended

    def wait(self, timeout_s: float) -> None:
        """Block until a fetch ends or `timeout_s` passes (nothing else to do)."""
        with self._done:
            if self._loads and not any(f.done() for f, _ in self._loads.values()):
                self._done.wait(timeout_s)

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def write(self, load: KVLoad, kv: torch.Tensor) -> None:
        """Write positions [start, start + num_tokens) of a fetched tensor into the load's
        blocks. Call on the engine thread, for a request that still waits for it."""
        num_tokens = load.params.num_tokens
        expected = self.kv_caches.token_payload_numel(num_tokens)
        if kv.dim() != 1 or kv.numel() != expected or kv.dtype != self.spec.dtype:
            raise KVTransferFailed(
                f"received KV of shape {tuple(kv.shape)} {kv.dtype}; expected [{expected}] "
                f"{self.spec.dtype}"
            )
        start, n = load.start_position, load.num_tokens
        self.kv_caches.write_tokens(load.block_ids, kv, num_tokens, start, n)
        self.num_loaded_bytes += n * self.spec.bytes_per_token

    def close(self) -> None:
        for future, _ in self._loads.values():
            future.cancel()
        self._loads.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def _fetch(self, params: KVTransferParams, deadline: float) -> torch.Tensor:
        if self.fetch_delay_s:
            time.sleep(self.fetch_delay_s)
        if self.fetch_gate is not None:
            self.fetch_gate.wait(max(deadline - time.monotonic(), 0.0))
        if time.monotonic() >= deadline:
            raise TimeoutError("the KV transfer timed out")
        if params.transport == "grpc" and self.config.kv_peer:  # where this engine pulls from
            params = dataclasses.replace(params, location=self.config.kv_peer)
        kv = self._fetchers[params.transport](params, deadline)
        dtype = self.spec.dtype
        expected = self.kv_caches.token_payload_numel(params.num_tokens) * dtype.itemsize
        if kv.numel() * kv.element_size() != expected:
            raise KVTransferFailed(
                f"received {kv.numel() * kv.element_size()} bytes of KV, expected {expected}"
            )
        return kv.reshape(-1).view(torch.uint8).view(dtype)  # raw bytes -> the flat payload

    def _notify(self, _future: concurrent.futures.Future) -> None:
        with self._done:
            self._done.notify_all()
