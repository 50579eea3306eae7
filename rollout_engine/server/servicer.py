"""The RolloutEngine servicer: each call through the `AsyncEngine`, answered in wire messages;
errors become statuses in `status`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_engine.engine.chat_template import (
    UNTRUSTED_TEMPLATE_MESSAGE,
    extend_tokens,
    render_chat,
)
from rollout_engine.engine.input_processor import InputProcessor
from rollout_engine.engine.scoring import score_output, score_params
from rollout_engine.protocol import (
    EngineSleepingError,
    InvalidRequestError,
    KVTransferError,
    LoRAError,
    LoRARequest,
    RequestOutputKind,
    SleepLevel,
    check_sleep_mode,
)
from rollout_engine.server import convert
from rollout_engine.server.async_engine import AsyncEngine
from rollout_engine.server.pull_kv import pull_kv_responses
from rollout_engine.server.status import streaming, unary
from rollout_engine.server.weight_receiver import WeightUpdateReceiver

_NUM_REQUESTS_FIELD = {"abort": "num_aborted_requests", "wait": "num_drained_requests",
                       "keep": "num_kept_requests"}
"""Which count of a Sleep or PauseGeneration response a mode fills."""


class RolloutEngineServicer(pb_grpc.RolloutEngineServicer):
    """Holds no engine state: the `AsyncEngine` it shares with the HTTP front-end does."""

    def __init__(self, engine: AsyncEngine, trust_request_chat_template: bool = False) -> None:
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        self._processor: InputProcessor | None = None
        """A tokenizer of this front-end's own for RenderChat, built at its first call."""

    # ------------------------------------------------------------------------ generation
    @streaming
    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[Any]:
        prompt = convert.prompt_from_proto(request.prompt)
        params = convert.sampling_params_from_proto(request.sampling_params)
        stream_deltas = request.stream_deltas if request.HasField("stream_deltas") else True
        kind = RequestOutputKind.DELTA_THEN_WHOLE if stream_deltas else RequestOutputKind.FINAL_ONLY
        lora_request = await self._lora_request(request.lora_name)
        async with self.engine.generate([prompt], [params], kind, "gen",
                                        lora_request=lora_request) as generation:
            is_first = True
            async for _, output in generation:
                yield convert.generate_response(generation.request_id, output, is_first)
                is_first = False

    @streaming
    async def GenerateBatch(self, request: pb.GenerateBatchRequest, context) -> AsyncIterator[Any]:
        if not request.prompts:
            raise InvalidRequestError("GenerateBatch needs at least one prompt")
        prompts = [convert.prompt_from_proto(p) for p in request.prompts]
        params = convert.batch_sampling_params(request)
        kind = RequestOutputKind.FINAL_ONLY
        lora_request = await self._lora_request(request.lora_name)
        async with self.engine.generate(prompts, params, kind, "batch",
                                        lora_request=lora_request) as generation:
            async for prompt_index, output in generation:
                for message in convert.batch_responses(convert.batch_completions(prompt_index,
                                                                                 output)):
                    yield message

    async def _lora_request(self, lora_name: str) -> LoRARequest | None:
        if not lora_name:
            return None
        lora_request = await self.engine.lora_request(lora_name)
        if lora_request is None:
            raise LoRAError(f"no LoRA adapter named {lora_name!r} is loaded (LoadLoRAAdapter)")
        return lora_request

    # --------------------------------------------------------------------------- scoring
    @unary
    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        sequences, prompt_lens, num_top = convert.score_request_from_proto(request)
        params = score_params(num_top)
        outputs = await self.engine.generate(
            sequences, [params] * len(sequences), RequestOutputKind.FINAL_ONLY, "score",
            prompt_logprobs_from=prompt_lens,
        ).final_outputs()
        if any(o.outputs[0].finish_reason == "abort" for o in outputs):
            raise EngineSleepingError(
                "scoring was aborted by a sleep or a KV cache release while it ran; wake the "
                "engine and score again"
            )
        return convert.score_response([
            score_output(output, prompt_len, num_top)
            for output, prompt_len in zip(outputs, prompt_lens)
        ])

    # ------------------------------------------------------------------------------- chat
    @unary
    async def RenderChat(self, request: pb.RenderChatRequest, context) -> pb.RenderChatResponse:
        prompt = convert.chat_prompt_from_proto(request)
        if prompt.chat_template is not None and not self.trust_request_chat_template:
            raise InvalidRequestError(UNTRUSTED_TEMPLATE_MESSAGE)
        if self._processor is None:
            model = self.engine.model
            self._processor = await asyncio.to_thread(
                InputProcessor, model.model, model.hf_config, model.max_model_len)
        rendered = await asyncio.to_thread(render_chat, self._processor, prompt)
        if request.tokens:
            rendered = await asyncio.to_thread(extend_tokens, self._processor, prompt, rendered,
                                               list(request.tokens))
        return pb.RenderChatResponse(prompt_token_ids=rendered.token_ids,
                                     prompt_text=rendered.text)

    # ---------------------------------------------------------------------- memory control
    @unary
    async def Sleep(self, request: pb.SleepRequest, context) -> pb.SleepResponse:
        level = SleepLevel.parse(request.level or SleepLevel.OFFLOAD_WEIGHTS)
        mode = check_sleep_mode(request.mode or "abort")
        num_requests = await self.engine.sleep(level, mode)
        return pb.SleepResponse(**{_NUM_REQUESTS_FIELD[mode]: num_requests})

    @unary
    async def PauseGeneration(self, request: pb.PauseGenerationRequest, context
                              ) -> pb.PauseGenerationResponse:
        mode = check_sleep_mode(request.mode or "abort")
        clear_cache = request.clear_cache if request.HasField("clear_cache") else True
        result = await self.engine.pause(mode, clear_cache)
        return pb.PauseGenerationResponse(**{_NUM_REQUESTS_FIELD[mode]: result.num_requests})

    @unary
    async def ResumeGeneration(self, request, context) -> pb.ResumeGenerationResponse:
        await self.engine.resume()
        return pb.ResumeGenerationResponse()

    @unary
    async def IsPaused(self, request, context) -> pb.IsPausedResponse:
        return pb.IsPausedResponse(is_paused=await self.engine.is_paused())

    @unary
    async def WakeUp(self, request: pb.WakeUpRequest, context) -> pb.WakeUpResponse:
        await self.engine.wake_up(list(request.tags) or None)
        return pb.WakeUpResponse()

    @unary
    async def ReleaseKVCache(self, request, context) -> pb.ReleaseKVCacheResponse:
        return pb.ReleaseKVCacheResponse(num_aborted_requests=await self.engine.release_kv_cache())

    @unary
    async def ResetPrefixCache(self, request, context) -> pb.ResetPrefixCacheResponse:
        await self.engine.reset_prefix_cache()
        return pb.ResetPrefixCacheResponse()

    # ---------------------------------------------------------------------- weight updates
    @streaming
    async def UpdateWeights(self, request_iterator, context) -> AsyncIterator[Any]:
        # A second update supersedes an open one: the engine aborts the older session, whose
        # next write then fails, so two streams can never interleave writes.
        async for message in WeightUpdateReceiver(self.engine).run(request_iterator):
            yield message

    # ------------------------------------------------------------------------------- LoRA
    @unary
    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context
                              ) -> pb.LoadLoRAAdapterResponse:
        if not request.lora_path:
            raise LoRAError("LoadLoRAAdapter needs a lora_path (push tensors with UpdateWeights)")
        added = await self.engine.load_lora_adapter(request.lora_name, request.lora_path,
                                                    load_inplace=request.load_inplace)
        adapter = await self.engine.loaded_lora(request.lora_name)
        return pb.LoadLoRAAdapterResponse(added=added, adapter=convert.lora_to_proto(adapter))

    @unary
    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context
                                ) -> pb.UnloadLoRAAdapterResponse:
        return pb.UnloadLoRAAdapterResponse(
            removed=await self.engine.unload_lora_adapter(request.lora_name))

    @unary
    async def ListLoRAAdapters(self, request, context) -> pb.ListLoRAAdaptersResponse:
        adapters = await self.engine.lora_adapters()
        return pb.ListLoRAAdaptersResponse(adapters=[convert.lora_to_proto(a) for a in adapters])

    # ------------------------------------------------------------------------ KV transfer
    @streaming
    async def PullKV(self, request: pb.PullKVRequest, context) -> AsyncIterator[Any]:
        store = self.engine.kv_store
        if store is None:
            raise KVTransferError(
                "this engine saves no KV for remote decodes; start it with --kv-role prefill"
            )
        async for message in pull_kv_responses(store, request.transfer_id, context):
            yield message

    # ----------------------------------------------------------------------- introspection
    @unary
    async def GetInfo(self, request, context) -> pb.GetInfoResponse:
        return convert.info_to_proto(await self.engine.info())

    @unary
    async def GetMemoryState(self, request, context) -> pb.GetMemoryStateResponse:
        return convert.memory_state_to_proto(await self.engine.memory_state())
