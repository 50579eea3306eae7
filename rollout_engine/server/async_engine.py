"""`AsyncEngine`: the one door every front-end uses to reach the engine (vLLM's `EngineClient`)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Self

import torch

from rollout_engine.protocol import (
    EngineInfo,
    InternalError,
    LoadedLoRA,
    LoRARequest,
    MemoryState,
    PauseMode,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    SleepLevel,
    SleepMode,
)
from rollout_engine.server.admission import Admission
from rollout_engine.server.engine_loop import EngineLoop, OutputSink, PauseResult

if TYPE_CHECKING:
    from rollout_engine.config import EngineConfig, ServerConfig
    from rollout_engine.engine.llm_engine import LLMEngine
    from rollout_engine.engine.request_stats import RequestStatsSnapshot
    from rollout_engine.worker.kv_transfer.kv_connector_worker import KVStore
    from rollout_engine.worker.weights.weight_update import ManifestEntry, WeightUpdateSession

Prompt = str | list[int]
CallLabel = Literal["gen", "batch", "score", "cmpl", "chatcmpl"]
"""Which kind of call a prompt came with; its engine request ids are `<label>-<N>:<i>`."""
NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ModelFacts:
    """What the front-ends know of the served model, read once when the server starts."""

    model: str
    """The checkpoint directory."""
    served_model_name: str
    """The name answers carry unless the server is given others (`--served-model-name`)."""
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    """The weights' dtype ("bfloat16")."""
    device: torch.device
    num_blocks: int
    """KV cache blocks in all."""
    config: EngineConfig
    hf_config: Any = dataclasses.field(compare=False)
    """The model's Hugging Face config (what a front-end's own tokenizer needs)."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """What `/metrics` renders: the engine's info (server counters merged), its per-request
    histograms, and whether generation is paused (or draining to pause)."""

    info: EngineInfo
    request_stats: RequestStatsSnapshot
    is_paused: bool


class AsyncEngine:
    """Typed async verbs over the engine thread, the admission every front-end shares, and the
    model's facts. gRPC, HTTP and the weight receiver hold one; only it and its private loop
    (engine_loop.py) name `LLMEngine`, and `Generation` is the one copy of "admit, add all or
    none, follow the outputs, abort what is pending".

    `start()` on the event loop that serves; `shutdown()` stops the thread, then the engine.
    """

    def __init__(self, engine: LLMEngine, config: ServerConfig, model_name: str = "") -> None:
        self._engine = engine
        self.model = _model_facts(engine, model_name)
        self._admission = Admission(config.max_inflight_requests, config.max_n)
        """One limit for gRPC and HTTP: a sample counts however it came."""
        self._kv_transfer = engine.kv_transfer
        self._engine_loop: EngineLoop | None = None
        self._ids = itertools.count()
        self._is_shut_down = False

    # ---------------------------------------------------------------------------- lifetime
    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        self._engine_loop = EngineLoop(self._engine, asyncio.get_running_loop())
        self._engine_loop.start()

    def shutdown(self) -> None:
        """Stop the engine thread (after the commands queued), then the engine (its threads,
        the other tensor-parallel ranks' processes). Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        if self._engine_loop is not None:
            self._engine_loop.stop()
        self._engine.shutdown()

    def is_responsive(self, stall_s: float) -> bool:
        """The engine thread is alive and no step or command has run for `stall_s` or more."""
        return self._loop.is_responsive(stall_s)

    @property
    def _loop(self) -> EngineLoop:
        if self._engine_loop is None:
            raise InternalError("the engine is not started: call AsyncEngine.start() first")
        return self._engine_loop

    # -------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        output_kind: RequestOutputKind,
        label: CallLabel,
        prompt_logprobs_from: Sequence[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Generation:
        """One call's prompts (one SamplingParams each), not started yet: see `Generation`.
        `prompt_logprobs_from`: per prompt, the first position whose prompt logprobs it asks
        for (scoring); None: every position but the first. `lora_request`: the LoRA adapter
        they run under (None: the base model)."""
        assert len(prompts) == len(params), (len(prompts), len(params))
        request_id = f"{label}-{next(self._ids)}"
        return Generation(self, request_id, list(zip(prompts, params)), output_kind,
                          prompt_logprobs_from, lora_request)

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these engine requests; fire and forget (safe from a cancelled call's `finally`)."""
        self._loop.abort(list(request_ids))

    # ---------------------------------------------------------------------- memory control
    async def sleep(self, level: SleepLevel, mode: SleepMode) -> int:
        """Release memory; the requests in flight are ended ("abort"), drained first ("wait")
        or kept ("keep"). How many it ended, drained or kept."""
        return await self._loop.sleep(level, mode)

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        await self._loop.call(functools.partial(self._engine.wake_up, tags=tags))

    async def release_kv_cache(self) -> int:
        """Free the KV pool only; how many requests it ended."""
        return await self._loop.call_ending_requests(self._engine.release_kv_cache_memory)

    async def reset_prefix_cache(self) -> None:
        await self._loop.call(self._engine.reset_prefix_cache)

    async def memory_state(self) -> MemoryState:
        return await self._loop.call(self._engine.memory_state)

    # ------------------------------------------------------------------------------- pause
    async def pause(self, mode: PauseMode, clear_cache: bool = True) -> PauseResult:
        """Stop scheduling at a step boundary, the requests in flight ended, drained or kept."""
        return await self._loop.pause(mode, clear_cache)

    async def resume(self) -> None:
        await self._loop.resume()

    async def is_paused(self) -> bool:
        """Paused, or draining to pause: no new prompt starts until a resume."""
        return await self._loop.is_paused()

    # ---------------------------------------------------------------------- weight updates
    async def begin_weight_update(self, manifest: Sequence[ManifestEntry]) -> WeightUpdate:
        """Every (name, shape, dtype) checked before a byte is written, then an open update
        (an open earlier one is aborted: superseded)."""
        session = await self._loop.call(self._engine.begin_weight_update, manifest)
        return WeightUpdate(self._loop, session)

    # -------------------------------------------------------------------------------- LoRA
    async def load_lora_adapter(self, lora_name: str, lora_path: str = "",
                                peft_config: Mapping[str, Any] | None = None,
                                tensors: Mapping[str, torch.Tensor] | None = None,
                                load_inplace: bool = False) -> bool:
        """Load an adapter by name from its path, or from a PEFT config and its tensors,
        checked whole (LoRAError, loading nothing, if refused). False if this very adapter is
        loaded already. `load_inplace` replaces the adapter of that name: requests running
        under the old one finish under it."""
        return await self._loop.call(functools.partial(
            self._engine.loras.add_named, lora_name, lora_path, peft_config, tensors,
            load_inplace))

    async def begin_lora_push(self, manifest: Sequence[ManifestEntry], lora_name: str,
                              peft_config: Mapping[str, Any], load_inplace: bool) -> LoRAPush:
        """An adapter pushed from memory: its manifest checked (names, shapes, rank) before a
        byte comes, its tensors staged in host memory, loaded at the commit."""
        metas = {name: torch.empty(shape, dtype=dtype, device="meta")
                 for name, shape, dtype in manifest}
        await self._loop.call(self._engine.loras.check, peft_config, metas)
        return LoRAPush(self._loop, self._engine, lora_name, peft_config, load_inplace)

    async def unload_lora_adapter(self, lora_name: str) -> bool:
        """False if no adapter has this name; requests running under it finish under it."""
        def unload() -> bool:
            request = self._engine.loras.by_name(lora_name)
            return request is not None and self._engine.remove_lora(request.lora_int_id)

        return await self._loop.call(unload)

    async def lora_adapters(self) -> list[LoadedLoRA]:
        return await self._loop.call(self._engine.loras.loaded)

    async def loaded_lora(self, lora_name: str) -> LoadedLoRA | None:
        """The loaded adapter of this name and its load (None: no such adapter)."""
        return await self._loop.call(self._engine.loras.loaded_by_name, lora_name)

    async def lora_request(self, lora_name: str) -> LoRARequest | None:
        """The loaded adapter of this name (None: no such adapter)."""
        return await self._loop.call(self._engine.loras.by_name, lora_name)

    # ------------------------------------------------------------------------ introspection
    async def info(self) -> EngineInfo:
        """The engine's info with the server's counters and admission numbers."""
        return self._with_server_counters(await self._loop.call(self._engine.info))

    async def metrics(self) -> MetricsSnapshot:
        engine = self._engine
        info, request_stats = await self._loop.call(
            lambda: (engine.info(), engine.request_stats()))
        return MetricsSnapshot(self._with_server_counters(info), request_stats,
                               await self.is_paused())

    def _with_server_counters(self, info: EngineInfo) -> EngineInfo:
        return dataclasses.replace(
            info, **self._loop.counters(),
            num_inflight_requests=self._admission.num_inflight_requests,
            max_inflight_requests=self._admission.max_inflight_requests)

    # -------------------------------------------------------------------------- KV transfer
    @property
    def kv_store(self) -> KVStore | None:
        """The KV a prefill saved for remote decodes (thread-safe: read off the engine
        thread); None without a KV role."""
        return None if self._kv_transfer is None else self._kv_transfer.store

    def set_kv_transfer_address(self, address: str) -> None:
        """How peers reach this server: written into the handles of KV saved here."""
        if self._kv_transfer is not None:
            self._kv_transfer.address = address


class Generation:
    """One call's prompts on the engine: admitted against the shared limit, added all or
    none, followed as the engine hands out their outputs, and aborted the moment the call
    ends early (cancelled, failed, a client gone).

        async with engine.generate(...) as generation:      # admitted and added
            async for prompt_index, output in generation:   # until every prompt finished
                ...

    Where the status must be known before a response starts (HTTP streams): `await start()`
    first, then iterate, and `close()` on every way out (it is idempotent).
    """

    def __init__(self, engine: AsyncEngine, request_id: str,
                 requests: list[tuple[Prompt, SamplingParams]], output_kind: RequestOutputKind,
                 prompt_logprobs_from: Sequence[int] | None,
                 lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        """The call's id; prompt i is engine request `<request_id>:<i>`."""
        self._engine = engine
        self._request_ids = [f"{request_id}:{i}" for i in range(len(requests))]
        self._index = {rid: i for i, rid in enumerate(self._request_ids)}
        self._requests = requests
        self._sink = OutputSink(output_kind)
        self._prompt_logprobs_from = prompt_logprobs_from
        self._lora_request = lora_request
        self._pending: set[str] = set()
        self._num_admitted = 0

    async def start(self) -> Self:
        """Admit (InvalidRequestError past --max-n, AdmissionError past the limit) and add
        every prompt, or none (the engine's checks raise here)."""
        params = [p for _, p in self._requests]
        self._num_admitted = self._engine._admission.acquire(params)
        self._pending = set(self._request_ids)
        try:
            await self._engine._loop.add_requests(
                [(rid, prompt, p) for rid, (prompt, p) in zip(self._request_ids, self._requests)],
                self._sink, self._prompt_logprobs_from, self._lora_request)
        except BaseException:  # refused, or cancelled while the add ran: abort all
            self.close()
            raise
        return self

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine hands them out, until every prompt finished;
        a failed step's error is raised here."""
        while self._pending:
            output = await self._sink.get()
            if output.finished:
                self._pending.discard(output.request_id)
            yield self._index[output.request_id], output

    async def final_outputs(self) -> list[RequestOutput]:
        """Each prompt's final output, in prompt order (FINAL_ONLY calls); started here and
        closed however this ends."""
        outputs: list[RequestOutput | None] = [None] * len(self._requests)
        async with self:
            async for i, output in self:
                if output.finished:
                    outputs[i] = output
        return outputs  # type: ignore[return-value]

    def close(self) -> None:
        """Abort the prompts still running and give their admission back."""
        if self._pending:
            self._engine.abort(sorted(self._pending))
            self._pending.clear()
        if self._num_admitted:
            self._engine._admission.release(self._num_admitted)
            self._num_admitted = 0

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class WeightUpdate:
    """An open weight update, written on the engine thread in the order the writes come."""

    def __init__(self, engine_loop: EngineLoop, session: WeightUpdateSession) -> None:
        self._engine_loop = engine_loop
        self._session = session

    def write(self, tensors: NamedTensors) -> asyncio.Future[None]:
        """Done once the bytes are in the weights, CUDA copies included (the sender may reuse
        its buffers then); the caller may receive the next bytes meanwhile."""
        write = self._session.write
        return asyncio.wrap_future(self._engine_loop.submit(lambda: _write_all(write, tensors)))

    async def finish(self) -> int:
        """Commit; the new weight version."""
        return await self._engine_loop.call(self._session.finish)

    def abort(self) -> None:
        """Give up, after the writes queued so far; the weights stay inconsistent until a
        complete update lands. Fire and forget."""
        self._engine_loop.submit(self._session.abort)

    def after_writes(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the engine thread after the writes queued so far (to close the buffers
        they read: never under a copy that reads them)."""
        self._engine_loop.submit(fn)


class LoRAPush:
    """A LoRA adapter pushed through the weight transports, with `WeightUpdate`'s interface:
    its tensors are copied out of the transport buffers into host memory as they come (on
    the engine thread, in order), and the adapter is loaded, checked whole, at `finish`."""

    def __init__(self, engine_loop: EngineLoop, engine: LLMEngine, lora_name: str,
                 peft_config: Mapping[str, Any], load_inplace: bool) -> None:
        self._engine_loop, self._engine = engine_loop, engine
        self._lora_name, self._peft_config = lora_name, peft_config
        self._load_inplace = load_inplace
        self._tensors: dict[str, torch.Tensor] = {}

    def write(self, tensors: NamedTensors) -> asyncio.Future[None]:
        def stage() -> None:
            for name, tensor in tensors:
                self._tensors[name] = tensor.to("cpu", copy=True)

        return asyncio.wrap_future(self._engine_loop.submit(stage))

    async def finish(self) -> LoadedLoRA:
        """Load the adapter; it, as it is served (its load included)."""
        def load() -> LoadedLoRA:
            loras = self._engine.loras
            loras.add_named(self._lora_name, "", self._peft_config, self._tensors,
                            self._load_inplace)
            return loras.loaded_by_name(self._lora_name)

        try:
            return await self._engine_loop.call(load)
        finally:
            self._tensors = {}

    def abort(self) -> None:
        """Drop what was staged (after the writes queued so far). Fire and forget."""
        self._engine_loop.submit(self._tensors.clear)

    def after_writes(self, fn: Callable[[], object]) -> None:
        self._engine_loop.submit(fn)


def _write_all(write: Callable[[str, torch.Tensor], object], tensors: NamedTensors) -> None:
    """On the engine thread; CUDA copies finish before the sender may reuse a buffer."""
    for name, tensor in tensors:
        write(name, tensor)
    for device in {t.device for _, t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def _model_facts(engine: LLMEngine, model_name: str) -> ModelFacts:
    config, limits = engine.config, engine.limits
    architectures = getattr(engine.hf_config, "architectures", None) or [""]
    return ModelFacts(
        model=config.model_config.model,
        served_model_name=model_name or config.model_config.model,
        architecture=architectures[0],
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
        eos_token_ids=tuple(limits.eos_token_ids),
        dtype=str(engine.worker.dtype).removeprefix("torch."),
        device=engine.device,
        num_blocks=limits.num_blocks,
        config=config,
        hf_config=engine.hf_config,
    )
