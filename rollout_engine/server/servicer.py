"""The RolloutEngine servicer: turns calls into engine-thread commands; holds no engine state."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_engine.engine.scoring import score_output, score_params
from rollout_engine.protocol import (
    EngineSleepingError,
    InvalidRequestError,
    KVTransferError,
    RequestOutput,
    RequestOutputKind,
    SleepLevel,
    check_sleep_mode,
)
from rollout_engine.server import convert
from rollout_engine.server.admission import Admission
from rollout_engine.server.engine_loop import EngineLoop, OutputSink
from rollout_engine.server.pull_kv import pull_kv_responses
from rollout_engine.server.status import streaming, unary
from rollout_engine.server.weight_receiver import WeightUpdateReceiver

if TYPE_CHECKING:
    from rollout_engine.config import ServerConfig

_NUM_REQUESTS_FIELD = {"abort": "num_aborted_requests", "wait": "num_drained_requests",
                       "keep": "num_kept_requests"}
"""Which count of a Sleep or PauseGeneration response a mode fills."""

class RolloutEngineServicer(pb_grpc.RolloutEngineServicer):
    """Every engine call runs on the engine thread (`EngineLoop`); errors become statuses in
    `status`."""

    def __init__(self, engine_loop: EngineLoop, config: ServerConfig,
                 admission: Admission | None = None) -> None:
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        # Shared with the HTTP front-end when `serve()` passes it: one limit for both.
        self.admission = admission or Admission(config.max_inflight_requests, config.max_n)
        self._ids = itertools.count()

    # ------------------------------------------------------------------------ generation
    @streaming
    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[Any]:
        prompt = convert.prompt_from_proto(request.prompt)
        params = convert.sampling_params_from_proto(request.sampling_params)
        stream_deltas = request.stream_deltas if request.HasField("stream_deltas") else True
        state = convert.GenerateStreamState(stream_deltas)
        request_id = f"gen-{next(self._ids)}"
        kind = RequestOutputKind.DELTA if stream_deltas else RequestOutputKind.FINAL_ONLY
        sink = OutputSink(kind)
        async with self.admission.admit([params]):
            finished = False
            try:
                # Inside the try: a call cancelled while the add runs still aborts it.
                await self.engine_loop.add_requests([(request_id, prompt, params)], sink)
                while not finished:
                    output = await sink.get()
                    finished = output.finished
                    message = state.response(output)
                    if message is not None:
                        yield message
            finally:
                if not finished:  # cancelled, deadline passed, failed, or the stream broke
                    self.engine_loop.abort([request_id])

    @streaming
    async def GenerateBatch(self, request: pb.GenerateBatchRequest, context) -> AsyncIterator[Any]:
        if not request.prompts:
            raise InvalidRequestError("GenerateBatch needs at least one prompt")
        prompts = [convert.prompt_from_proto(p) for p in request.prompts]
        params = convert.batch_sampling_params(request)
        base_id = f"batch-{next(self._ids)}"
        request_ids = [f"{base_id}:{i}" for i in range(len(prompts))]
        state = convert.BatchStreamState(request_ids)
        sink = OutputSink(RequestOutputKind.FINAL_ONLY)
        async with self.admission.admit(params):
            pending = set(request_ids)
            try:
                await self.engine_loop.add_requests(list(zip(request_ids, prompts, params)), sink)
                while pending:
                    output = await sink.get()
                    if output.finished:
                        pending.discard(output.request_id)
                    for message in convert.batch_responses(state.new_completions(output)):
                        yield message
            finally:
                if pending:
                    self.engine_loop.abort(sorted(pending))

    # --------------------------------------------------------------------------- scoring
    @unary
    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        sequences, prompt_lens, num_top = convert.score_request_from_proto(request)
        params = score_params(num_top)
        base_id = f"score-{next(self._ids)}"
        request_ids = [f"{base_id}:{i}" for i in range(len(sequences))]
        sink = OutputSink(RequestOutputKind.FINAL_ONLY)
        outputs: dict[str, RequestOutput] = {}
        async with self.admission.admit([params] * len(sequences)):
            try:
                await self.engine_loop.add_requests(
                    [(rid, seq, params) for rid, seq in zip(request_ids, sequences)], sink,
                    prompt_logprobs_from=prompt_lens,
                )
                while len(outputs) < len(request_ids):
                    output = await sink.get()
                    if output.finished:
                        outputs[output.request_id] = output
            finally:
                if len(outputs) < len(request_ids):
                    self.engine_loop.abort(sorted(set(request_ids) - set(outputs)))
        if any(o.outputs[0].finish_reason == "abort" for o in outputs.values()):
            raise EngineSleepingError(
                "scoring was aborted by a sleep or a KV cache release while it ran; wake the "
                "engine and score again"
            )
        return convert.score_response([
            score_output(outputs[rid], prompt_len, num_top)
            for rid, prompt_len in zip(request_ids, prompt_lens)
        ])

    # ---------------------------------------------------------------------- memory control
    @unary
    async def Sleep(self, request: pb.SleepRequest, context) -> pb.SleepResponse:
        level = SleepLevel.parse(request.level or SleepLevel.OFFLOAD_WEIGHTS)
        mode = check_sleep_mode(request.mode or "abort")
        num_requests = await self.engine_loop.sleep(level, mode)
        return pb.SleepResponse(**{_NUM_REQUESTS_FIELD[mode]: num_requests})

    @unary
    async def PauseGeneration(self, request: pb.PauseGenerationRequest, context
                              ) -> pb.PauseGenerationResponse:
        mode = check_sleep_mode(request.mode or "abort")
        clear_cache = request.clear_cache if request.HasField("clear_cache") else True
        result = await self.engine_loop.pause(mode, clear_cache)
        return pb.PauseGenerationResponse(**{_NUM_REQUESTS_FIELD[mode]: result.num_requests})

    @unary
    async def ResumeGeneration(self, request, context) -> pb.ResumeGenerationResponse:
        await self.engine_loop.resume()
        return pb.ResumeGenerationResponse()

    @unary
    async def IsPaused(self, request, context) -> pb.IsPausedResponse:
        return pb.IsPausedResponse(is_paused=await self.engine_loop.is_paused())

    @unary
    async def WakeUp(self, request: pb.WakeUpRequest, context) -> pb.WakeUpResponse:
        tags = list(request.tags) or None
        await self.engine_loop.call(functools.partial(self.engine.wake_up, tags=tags))
        return pb.WakeUpResponse()

    @unary
    async def ReleaseKVCache(self, request, context) -> pb.ReleaseKVCacheResponse:
        release = self.engine.release_kv_cache_memory
        num_aborted = await self.engine_loop.call_ending_requests(release)
        return pb.ReleaseKVCacheResponse(num_aborted_requests=num_aborted)

    @unary
    async def ResetPrefixCache(self, request, context) -> pb.ResetPrefixCacheResponse:
        await self.engine_loop.call(self.engine.reset_prefix_cache)
        return pb.ResetPrefixCacheResponse()

    # ---------------------------------------------------------------------- weight updates
    @streaming
    async def UpdateWeights(self, request_iterator, context) -> AsyncIterator[Any]:
        # A second update supersedes an open one: the engine aborts the older session, whose
        # next write then fails, so two streams can never interleave writes.
        async for message in WeightUpdateReceiver(self.engine_loop).run(request_iterator):
            yield message

    # ------------------------------------------------------------------------ KV transfer
    @streaming
    async def PullKV(self, request: pb.PullKVRequest, context) -> AsyncIterator[Any]:
        kv_transfer = self.engine.kv_transfer
        if kv_transfer is None:
            raise KVTransferError(
                "this engine saves no KV for remote decodes; start it with --kv-role prefill"
            )
        # The store is thread-safe: no need to go through the engine thread.
        async for message in pull_kv_responses(kv_transfer.store, request.transfer_id, context):
            yield message

    # ----------------------------------------------------------------------- introspection
    @unary
    async def GetInfo(self, request, context) -> pb.GetInfoResponse:
        info = await self.engine_loop.call(self.engine.info)
        info = dataclasses.replace(
            info,
            **self.engine_loop.counters(),
            num_inflight_requests=self.admission.num_inflight_requests,
            max_inflight_requests=self.admission.max_inflight_requests,
        )
        return convert.info_to_proto(info)

    @unary
    async def GetMemoryState(self, request, context) -> pb.GetMemoryStateResponse:
        state = await self.engine_loop.call(self.engine.memory_state)
        return convert.memory_state_to_proto(state)
