"""The rollout engine behind TRL's AsyncGRPOTrainer: rollouts over HTTP, weights over gRPC.

AsyncGRPOTrainer generates with a rollout worker (a child process) that posts to a `vllm
serve` HTTP API (`/v1/completions` with token ids and `logprobs=0`, `/v1/models`, `/health`)
at `AsyncGRPOConfig.vllm_server_base_url`, while training goes on; every `weight_sync_steps`
it calls its `WeightTransferProtocol`: `pause()`, `send_weights(iterator)`, `resume()`.
`rollout-engine serve --http-port` answers that HTTP API, and `EngineWeightTransfer` is the
protocol over the engine's gRPC transports (stream, shm, cuda_ipc) instead of vLLM's NCCL
group. Its pause keeps the requests in flight (`pause_generation("keep")`): they go on with
the new weights after the sync instead of being aborted, so a rollout may span two versions.

    from trainer_bridge.trl_async import EngineAsyncGRPOTrainer
    trainer = EngineAsyncGRPOTrainer(
        model=model_dir, reward_funcs=reward, train_dataset=dataset, engine="127.0.0.1:50051",
        args=AsyncGRPOConfig(..., vllm_server_base_url="http://127.0.0.1:8000"))
    trainer.train()

A PEFT (LoRA) policy is served unmerged when the engine runs with `--enable-lora` (TRL reads
that from `/server_info`, with its own checks of the adapter and of `--max-loras` against
`max_staleness`): each sync loads the adapter alone as a new version, `trl-policy-v{N}`, which
the worker's requests then name, and unloads the one that fell out of the staleness window, as
TRL's AsyncGRPO does with vLLM. `lora_sync` says how the adapter travels: "memory" (the
default) pushes its tensors over the gRPC transports, no disk; "path" is TRL's own sync (the
adapter saved under `output_dir`, read by the server through `/v1/load_lora_adapter`: the
server must see that directory); "merged" merges it into the base and pushes full weights.

With `tools=`, the worker sends each turn after the first as token in
(`/v1/chat/completions/tokens`, trl_async_turns.py), so every turn extends the tokens the
trainer holds: serve with `--trust-request-chat-template` (the worker sends its template).

The HTTP API must take requests without an API key (TRL's worker sends none): serve it on
loopback without `--api-key`. The worker needs `aiohttp`; vLLM itself is not needed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from trl.experimental.async_grpo import (
    AsyncGRPOTrainer,
    async_grpo_trainer,
    async_rollout_worker,
)

from rollout_engine.protocol import LoadedLoRA
from trainer_bridge.client import EngineClient
from trainer_bridge.lora_sync import PolicyAdapter
from trainer_bridge.trainer_weights import is_peft_model
from trainer_bridge.transports import WeightManifest, named_tensors
from trainer_bridge.trl_async_turns import TokenInRolloutWorker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSync:
    """One sync as the engine saw it."""

    weight_version: int
    """The engine's weight version after the update."""
    num_kept_requests: int
    """Requests in flight at the pause, kept (not aborted) across the update."""
    adapter: LoadedLoRA | None = None
    """A LoRA policy's sync: the adapter version it loaded (the base weights untouched)."""
    num_bytes: int = 0
    """Bytes of tensors pushed."""


LoRASync = Literal["memory", "path", "merged"]


class EngineWeightTransfer:
    """TRL's `WeightTransferProtocol` (AsyncGRPOTrainer's `weight_transfer`) over gRPC.

    `pause` freezes generation with the requests in flight kept (their KV dropped, so they
    are recomputed with the new weights), `send_weights` streams the trainer's (Hugging Face
    named) parameters with `EngineClient.update_weights`, `resume` lets the kept requests
    go on. The first sync reads the trainer's iterator into a list to learn the manifest;
    later ones stream it one tensor at a time against that manifest.
    """

    def __init__(
        self,
        engine: EngineClient | str,
        *,
        auth_token: str | None = None,
        transport: str = "auto",
        weight_dtype: torch.dtype | Literal["engine"] | None = None,
        ready_timeout_s: float = 60.0,
    ) -> None:
        self._owns_client = isinstance(engine, str)
        self._auth_token = auth_token
        self.client = EngineClient(engine, auth_token=auth_token) if self._owns_client else engine
        self.transport = transport
        self.weight_dtype = weight_dtype
        """Cast the weights to this dtype as they are sent ("engine": the engine's dtype)."""
        self.ready_timeout_s = ready_timeout_s
        self.syncs: list[WeightSync] = []
        """Every completed sync, in order."""
        self._manifest: WeightManifest | None = None
        self._num_kept_requests = 0

    # ------------------------------------------------------------ WeightTransferProtocol
    def init_weight_transfer(self) -> None:
        """Wait for the engine; resolve `weight_dtype="engine"`."""
        self.client.wait_until_ready(self.ready_timeout_s)
        if self.weight_dtype == "engine":
            self.weight_dtype = getattr(torch, self.client.info().dtype)

    def pause(self) -> None:
        self._num_kept_requests = self.client.pause_generation("keep")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        dtype = self.weight_dtype if isinstance(self.weight_dtype, torch.dtype) else None
        weights: Iterable[tuple[str, torch.Tensor]] = iterator
        if self._manifest is None:
            weights = named_tensors(iterator)
            self._manifest = WeightManifest.of(weights)
            self._check_dtype(self._manifest, dtype)
        version = self.client.update_weights(weights, transport=self.transport,
                                             manifest=self._manifest, dtype=dtype)
        self.syncs.append(WeightSync(version, self._num_kept_requests,
                                     num_bytes=self._manifest.num_bytes))

    def send_adapter(self, policy: PolicyAdapter) -> LoadedLoRA:
        """Push a LoRA policy's adapter alone, from memory, as `policy.lora_name` (between
        `pause` and `resume`, as `send_weights`)."""
        dtype = self.weight_dtype if isinstance(self.weight_dtype, torch.dtype) else None
        tensors = policy.adapter()  # read once: PEFT gathers them from the model
        adapter = self.client.load_lora_adapter(policy.lora_name, tensors, policy.peft_config,
                                                transport=self.transport, dtype=dtype)
        self.syncs.append(WeightSync(self.client.info().weight_version, self._num_kept_requests,
                                     adapter, sum(t.nbytes for t in tensors.values())))
        return adapter

    def resume(self) -> None:
        self.client.resume_generation()

    def destroy(self) -> None:
        """Close a client this transfer opened (its channel, its shared-memory buckets); a
        fresh channel, idle until used, takes its place for a later `train()`."""
        if self._owns_client:
            self.client.close()
            self.client = EngineClient(self.client.address, auth_token=self._auth_token)

    # --------------------------------------------------------------------------- internals
    def _check_dtype(self, manifest: WeightManifest, dtype: torch.dtype | None) -> None:
        """Refuse at the first sync, with the fix, weights the engine would refuse."""
        if dtype is not None:
            return
        engine_dtype = self.client.info().dtype
        dtypes = {str(m.dtype).removeprefix("torch.") for m in manifest.tensors
                  if m.dtype.is_floating_point}
        if dtypes - {engine_dtype}:
            raise ValueError(
                f"the trainer's weights are {sorted(dtypes)} but the engine serves "
                f"{engine_dtype}; set AsyncGRPOConfig(dtype={engine_dtype!r}), pass "
                f"weight_dtype='engine' to cast them as they are sent, or serve the engine "
                f"with --dtype {min(dtypes)}"
            )


class EngineAsyncGRPOTrainer(AsyncGRPOTrainer):
    """`AsyncGRPOTrainer` whose weights go to the engine through an `EngineWeightTransfer`
    (`weight_transfer`, or one built for `engine`: a gRPC address or client); TRL's rollout
    worker generates over the engine's HTTP API at `args.vllm_server_base_url`, its later tool
    turns as token in (trl_async_turns.py); `request_extras` join every generation request.
    A LoRA policy syncs its adapter alone, as `lora_sync` says (see the module doc)."""

    def __init__(
        self,
        *args: Any,
        engine: EngineClient | str | None = None,
        weight_transfer: EngineWeightTransfer | None = None,
        request_extras: dict[str, Any] | None = None,
        lora_sync: LoRASync = "memory",
        **kwargs: Any,
    ) -> None:
        if (engine is None) == (weight_transfer is None):
            raise TypeError("pass either `engine` (a gRPC address or EngineClient) or "
                            "`weight_transfer` (an EngineWeightTransfer), not both")
        if lora_sync not in get_args(LoRASync):
            raise ValueError(f"lora_sync must be one of {get_args(LoRASync)}, got {lora_sync!r}")
        if weight_transfer is None:
            weight_transfer = EngineWeightTransfer(engine)
        self.engine_transfer = weight_transfer
        self.lora_sync = lora_sync
        # TRL syncs an adapter alone only when it owns the sync (no weight_transfer given);
        # its adapter sync then runs through `_sync_weight_lora` below.
        adapter_sync = lora_sync != "merged" and _trains_peft_model(args, kwargs)
        with _token_in_rollout_worker(request_extras):
            super().__init__(*args, weight_transfer=None if adapter_sync else weight_transfer,
                             **kwargs)
        if adapter_sync and lora_sync == "memory" and self.is_fsdp_enabled:
            raise ValueError("lora_sync='memory' reads the adapter on the main process, which "
                             "FSDP shards: use lora_sync='path' (TRL's collective save)")

    def _init_lora_sync(self, model: Any) -> bool:
        """TRL's probe of the server (`/server_info`) and of the adapter; here a refusal is an
        error, since TRL's fallback (merged weights over NCCL) is not this engine's."""
        if not super()._init_lora_sync(model):
            raise ValueError(
                "the engine cannot serve this LoRA policy unmerged (TRL's warning above says "
                "why): serve it with --enable-lora, or pass lora_sync='merged'")
        return True

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        """Load the adapter as `trl-policy-v{N}`: from memory over gRPC ("memory"), or by
        TRL's own path sync ("path"); unload the version the staleness window let go."""
        if self.lora_sync == "path":
            return super()._sync_weight_lora(t0)
        version = self.model_version + 1
        transfer, is_main = self.engine_transfer, self.accelerator.is_main_process
        if is_main:
            if not transfer.syncs:
                transfer.init_weight_transfer()
            transfer.pause()
        t_pause = time.time()
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        if is_main:
            transfer.send_adapter(PolicyAdapter(
                self.accelerator.unwrap_model(self.model), f"{self._lora_name}-v{version}",
                adapter_name=self._adapter_name))
        t_transfer = time.time()
        self.accelerator.wait_for_everyone()
        if is_main:
            # Loaded before the worker's version moves: it names the adapter by that version.
            transfer.resume()
            stale_version = version - (self.args.max_staleness + 1)
            if stale_version > 0:
                transfer.client.unload_lora_adapter(f"{self._lora_name}-v{stale_version}")
            self.model_version = version
            if self.rollout_worker:
                self.rollout_worker.update_model_version(version)
        return t_pause, t_barrier, t_transfer


def _trains_peft_model(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether AsyncGRPOTrainer(*args, **kwargs) trains a PEFT model (given, or built from
    `peft_config`)."""
    bound = inspect.signature(AsyncGRPOTrainer.__init__).bind_partial(None, *args, **kwargs)
    arguments = bound.arguments
    return arguments.get("peft_config") is not None or is_peft_model(arguments.get("model"))


@contextlib.contextmanager
def _token_in_rollout_worker(request_extras: dict[str, Any] | None) -> Iterator[None]:
    """While AsyncGRPOTrainer builds its default rollout worker: build ours instead
    (`TokenInRolloutWorker`: later tool turns as token in), and let it be built without vLLM
    installed (TRL's refuses, though it only speaks HTTP to the server)."""
    check, worker = async_rollout_worker.is_vllm_available, async_grpo_trainer.AsyncRolloutWorker
    async_rollout_worker.is_vllm_available = lambda *args, **kwargs: True
    async_grpo_trainer.AsyncRolloutWorker = functools.partial(
        TokenInRolloutWorker, request_extras=request_extras)
    try:
        yield
    finally:
        async_rollout_worker.is_vllm_available = check
        async_grpo_trainer.AsyncRolloutWorker = worker
