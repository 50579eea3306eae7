"""The KV connector as `LLMEngine` drives it (prefill–decode disaggregation): the ledger's
half (`core.kv_connector_scheduler`, in the scheduler) and the bytes' half
(`worker.kv_transfer`, over `worker.kv_transports`), called at three points of the step loop:

- when a request arrives: is its handle usable here (`check_request`, from the input
  processor);
- before scheduling: write the transfers that arrived, or have failed prompts recomputed
  (`land_loads`); after scheduling: start the transfers the step asked for (`start`);
- after a step lands: save the KV of prefills that finished for a remote decode
  (`save_finished_prefills`), so their completions leave with a handle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from rollout_engine.config import EngineConfig
from rollout_engine.core.scheduler import Scheduler
from rollout_engine.core.scheduler_output import KVLoad
from rollout_engine.protocol import KVTransferParams
from rollout_engine.worker.kv_transfer.kv_connector_worker import KVTransfer, kv_layout_key
from rollout_engine.worker.kv_transfer.kv_transports import GrpcFetcher, fetch_cuda_ipc
from rollout_engine.worker.worker import Worker

logger = logging.getLogger(__name__)


class EngineKVConnector:
    """Moves prompts' KV between this engine and its peers, as its `kv_role` allows."""

    def __init__(
        self, scheduler: Scheduler, transfer: KVTransfer, weight_version: Callable[[], int]
    ) -> None:
        self.scheduler = scheduler
        self.transfer = transfer
        self._weight_version = weight_version

    @classmethod
    def build(
        cls, config: EngineConfig, hf_config, worker: Worker, scheduler: Scheduler
    ) -> EngineKVConnector | None:
        """The connector of an engine with a `kv_role`; None without one."""
        kv_config = config.kv_transfer_config
        if kv_config.kv_role is None:
            return None
        transfer = KVTransfer(
            worker.model_runner.kv_caches, kv_layout_key(hf_config, worker.kv_spec), kv_config,
            {"grpc": GrpcFetcher(), "cuda_ipc": fetch_cuda_ipc},
            worker.weights.fingerprint,
        )
        return cls(scheduler, transfer, lambda: worker.weights.weight_version)

    def check_request(self, params: KVTransferParams, prompt_token_ids: Sequence[int]) -> None:
        self.transfer.check_request(params, prompt_token_ids, self._weight_version())

    # ------------------------------------------------------------------ decode side
    def start(self, loads: Sequence[KVLoad]) -> None:
        self.transfer.start(loads)

    def land_loads(self) -> None:
        """Write the KV of transfers that arrived into their blocks, for requests that still
        wait for it; a failed or late transfer has its prompt computed here."""
        for request_id, result in self.transfer.poll():
            load = self.scheduler.kv_connector.load_of(request_id)
            if load is None:
                continue  # aborted meanwhile: dropped (its blocks were freed at the abort)
            succeeded = False
            if isinstance(result, BaseException):
                logger.warning("KV transfer for %s failed (%s: %s); computing its prompt here",
                               request_id, type(result).__name__, result)
            else:
                try:
                    self.transfer.write(load, result)
                    succeeded = True
                except Exception as exc:  # noqa: BLE001 - recompute instead
                    logger.warning("writing the KV of %s failed (%s); computing its prompt "
                                   "here", request_id, exc)
            self.scheduler.finish_kv_load(request_id, succeeded)

    def wait_for_loads(self, timeout_s: float) -> bool:
        """When nothing else can run: wait (bounded) for a transfer; False if none is on."""
        if not self.scheduler.kv_connector.num_loading:
            return False
        self.transfer.wait(timeout_s)
        return True

    # ------------------------------------------------------------------ prefill side
    def save_finished_prefills(self) -> None:
        """Publish the KV of prompts that finished for a remote decode; their completions
        carry the handle. A failed save leaves no handle (the decode engine then computes the
        prompt) and never fails the request."""
        ledger = self.scheduler.kv_connector
        for request in ledger.take_to_save():
            try:
                request.kv_transfer_handle = self.transfer.save(
                    self.scheduler.kv_cache_manager.get_block_ids(request.request_id),
                    request.prompt_token_ids, self._weight_version(),
                )
            except Exception as exc:  # noqa: BLE001 - the completion goes out without it
                logger.warning("saving the KV of %s failed: %s: %s", request.request_id,
                               type(exc).__name__, exc)
            finally:
                ledger.saved(request)

    # ------------------------------------------------------------------ the rest
    def stats(self) -> dict[str, float]:
        ledger = self.scheduler.kv_connector
        return {
            "kv_num_saved": self.transfer.num_saved,
            "kv_saved_bytes": self.transfer.num_saved_bytes,
            "kv_loaded_bytes": self.transfer.num_loaded_bytes,
            "kv_loaded_tokens": ledger.num_loaded_tokens,
            "kv_load_failures": ledger.num_load_failures,
            "kv_bytes_per_token": self.transfer.bytes_per_token,
        }

    def close(self) -> None:
        self.transfer.close()
