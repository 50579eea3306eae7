"""The RL control endpoints `vllm serve` keeps behind its dev mode: `/server_info`,
`/get_world_size`, `/reset_prefix_cache`, `/sleep`, `/wake_up`, `/is_sleeping`, `/pause`,
`/resume`, `/is_paused`. Mounted on a loopback bind, or with `--enable-control-endpoints`.

Each is one verb of the `AsyncEngine`, as its gRPC twin is. The weight transfer endpoints
answer with the client to use instead: weights go over gRPC.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from rollout_engine.protocol import MAX_LOGPROBS, SamplingParams, SleepLevel, check_sleep_mode
from rollout_engine.server.http.context import ServingContext, serving
from rollout_engine.server.http.error_responses import NotServedHereError, json_response

router = APIRouter()
weight_transfer_router = APIRouter()
"""Always mounted: a trainer pointed here learns which client to use instead of a 404."""

WEIGHT_TRANSFER_PATHS = (
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update", "/collective_rpc",
)
"""vLLM's weight-transfer endpoints (TRL's VLLMClient posts to the first four)."""


@router.get("/server_info")
async def server_info(request: Request,
                      config_format: Literal["text", "json"] = "text") -> Response:
    """vLLM's shape: `vllm_config` with `model_config.dtype` and `max_model_len`, the parallel
    layout, `lora_config` (null unless `--enable-lora`: TRL's probe for adapter-only sync) and
    `weight_transfer_config` null (no NCCL weight-transfer engine here)."""
    config = vllm_config(serving(request))
    return json_response({"vllm_config": config if config_format == "json" else str(config)})


def vllm_config(ctx: ServingContext) -> dict:
    model = ctx.engine.model
    config = model.config
    tp_size = config.parallel_config.tensor_parallel_size
    lora = config.lora_config
    return {
        "model_config": {
            "model": model.model, "served_model_name": ctx.model_name,
            "tokenizer": model.model, "dtype": model.dtype,
            "max_model_len": ctx.max_model_len, "seed": config.model_config.seed,
            "max_logprobs": MAX_LOGPROBS, "logprobs_mode": SamplingParams().logprobs_mode,
        },
        "cache_config": {"block_size": config.cache_config.block_size,
                         "num_gpu_blocks": model.num_blocks,
                         "enable_prefix_caching": config.cache_config.enable_prefix_caching},
        "parallel_config": {"tensor_parallel_size": tp_size, "pipeline_parallel_size": 1,
                            "data_parallel_size": 1, "world_size": tp_size},
        "scheduler_config": {"max_num_batched_tokens":
                             config.scheduler_config.max_num_batched_tokens,
                             "max_num_seqs": config.scheduler_config.max_num_seqs,
                             "async_scheduling": config.scheduler_config.async_scheduling},
        "lora_config": {"max_lora_rank": lora.max_lora_rank, "max_loras": lora.max_loras,
                        "max_cpu_loras": lora.num_cpu_loras} if lora.enable_lora else None,
        "weight_transfer_config": None,
        "engine_config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
    }


@router.get("/get_world_size")
async def get_world_size(request: Request) -> Response:
    config = serving(request).engine.model.config
    return json_response({"world_size": config.parallel_config.tensor_parallel_size})


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    await serving(request).engine.reset_prefix_cache()
    return json_response({"success": True})


@router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "abort") -> Response:
    """Release memory (1: offload weights, drop KV; 2: drop both). `mode`: "abort" ends the
    requests in flight, "wait" drains them first, "keep" freezes them across the sleep."""
    await serving(request).engine.sleep(SleepLevel.parse(level), check_sleep_mode(mode))
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None
                  ) -> Response:
    await serving(request).engine.wake_up(tags or None)
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> Response:
    state = await serving(request).engine.memory_state()
    return json_response({"is_sleeping": state.is_sleeping})


@router.post("/pause")
async def pause(request: Request, mode: str = "abort", clear_cache: bool = True) -> Response:
    """Stop scheduling at a step boundary (vLLM's `/pause`): "abort" ends the requests in
    flight, "wait" drains them, "keep" freezes them until `/resume` (their streams wait).
    A `/resume` during a "wait" drain cancels the pause: this answers 200 once drained (as
    vLLM's does), with `{"status": "resumed"}`: generation is running."""
    result = await serving(request).engine.pause(check_sleep_mode(mode), clear_cache)
    return json_response({"status": "paused" if result.is_paused else "resumed"})


@router.post("/resume")
async def resume(request: Request) -> Response:
    await serving(request).engine.resume()
    return json_response({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> Response:
    """True while paused, and from a "wait" pause's start: no new request starts meanwhile."""
    return json_response({"is_paused": await serving(request).engine.is_paused()})


async def _weights_go_over_grpc(request: Request) -> Response:
    raise NotServedHereError(
        f"{request.url.path}: this server takes weight updates over gRPC, not through vLLM's "
        "NCCL weight-transfer engine; push them with trainer_bridge.EngineClient(<the gRPC "
        "address>).update_weights(named_tensors) (transports: stream, shm, cuda_ipc)")


for _path in WEIGHT_TRANSFER_PATHS:
    weight_transfer_router.add_api_route(_path, _weights_go_over_grpc, methods=["POST"],
                         include_in_schema=False)
