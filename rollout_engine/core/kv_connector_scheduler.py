"""The scheduler's half of the KV connector (prefill–decode disaggregation). No torch.

Decode side: a request carrying a handle (`KVTransferParams.do_remote_prefill`) has its blocks
allocated for the positions a remote engine holds (`num_external_computed_tokens`), and waits
while a transfer fills them. The blocks stay out of the prefix cache, and out of the step
being scheduled, until the transfer lands (`delay_cache_blocks`): a request sharing the prompt
computes its own KV meanwhile instead of reading blocks whose data is still on the wire. A
transfer that fails or times out leaves the request to compute its prompt here; one that lands
after its request was aborted is dropped (the blocks were freed at the abort: only the engine
thread writes them, and only for a request that still waits).

Prefill side: a request for a remote decode (`do_remote_decode`) keeps its blocks when it
finishes, until the engine has saved their KV.

The worker's half (save, fetch, write) is `rollout_engine.worker.kv_transfer.kv_connector_worker.KVTransfer`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_engine.core.block_pool import KVBlock
from rollout_engine.core.kv_cache_manager import KVCacheManager
from rollout_engine.core.request import Request, RequestStatus
from rollout_engine.core.scheduler_output import KVLoad


class KVConnectorScheduler:
    """Which requests wait for remote KV, and which finished prefills hold their blocks."""

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._loading: dict[str, Request] = {}
        self._to_save: dict[str, Request] = {}
        self.num_loaded_tokens = 0
        self.num_load_failures = 0

    # ------------------------------------------------------------------ decode side
    @property
    def num_loading(self) -> int:
        """Requests waiting for a KV transfer."""
        return len(self._loading)

    @property
    def loading_requests(self) -> list[Request]:
        return list(self._loading.values())

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Positions the remote engine holds beyond the local prefix-cache hits. The last
        prompt token is always computed here: its logits are needed."""
        num_remote = min(request.kv_transfer_params.num_tokens, request.num_prompt_tokens - 1)
        return max(num_remote - num_local_tokens, 0)

    def start_load(
        self, request: Request, hit_blocks: Sequence[KVBlock], num_hit_tokens: int,
        num_external: int,
    ) -> KVLoad | None:
        """Allocate the blocks the transfer fills (after the local hits) and mark the request
        as waiting for them; None, changing nothing, if the pool has no room."""
        if not self.kv_cache_manager.allocate_slots(
            request, num_external, hit_blocks, delay_cache_blocks=True
        ):
            return None
        request.num_computed_tokens = num_hit_tokens
        request.num_external_computed_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._loading[request.request_id] = request
        return self.load_of(request.request_id)

    def load_of(self, request_id: str) -> KVLoad | None:
        """The transfer a request still waits for; None once it was aborted or is done."""
        request = self._loading.get(request_id)
        if request is None:
            return None
        return KVLoad(
            request_id, request.kv_transfer_params,
            tuple(self.kv_cache_manager.get_block_ids(request_id)),
            request.num_computed_tokens, request.num_external_computed_tokens,
        )

    def finish_load(self, request_id: str, succeeded: bool) -> Request | None:
        """A transfer ended; the request to queue again (None if it was aborted meanwhile).

        Succeeded: its KV is written, the positions count as computed, and the blocks enter
        the prefix cache only now. Failed or timed out: the blocks are freed and the request
        computes its prompt itself. Either way it never loads again."""
        request = self._loading.pop(request_id, None)
        if request is None:
            return None
        request.kv_transfer_params = None
        if succeeded:
            request.num_computed_tokens += request.num_external_computed_tokens
            self.num_loaded_tokens += request.num_external_computed_tokens
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        else:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.num_external_computed_tokens = 0
            self.num_load_failures += 1
        return request

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted: a transfer that lands later is dropped."""
        self._loading.pop(request_id, None)

    # ------------------------------------------------------------------ prefill side
    def hold_for_save(self, request: Request) -> bool:
        """Keep a finished prefill's blocks until its KV is saved (not if it was aborted)."""
        if not request.saves_kv or request.finish_reason == "abort":
            return False
        self._to_save[request.request_id] = request
        return True

    def take_to_save(self) -> list[Request]:
        """Finished prefills whose blocks hold KV to save; the engine saves each, then calls
        `saved`."""
        return list(self._to_save.values())

    def saved(self, request: Request) -> None:
        """The request's KV is saved (or saving failed): free its blocks."""
        if self._to_save.pop(request.request_id, None) is not None:
            self.kv_cache_manager.free(request)
