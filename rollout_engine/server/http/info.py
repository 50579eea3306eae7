"""What anyone may ask the server: `/health`, `/version`, `/v1/models` (with `max_model_len`)
and `/metrics` (Prometheus text: requests, tokens, KV blocks, sleep and pause state, and
vLLM's `vllm:*` families, see metrics.py)."""

from __future__ import annotations

import time
from importlib import metadata

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.protocol import EngineInfo
from rollout_engine.server.http.context import ServingContext, serving
from rollout_engine.server.http.error_responses import error_body, json_response

router = APIRouter()
_CREATED_S = int(time.time())


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine thread is alive and no step has run for `--engine-stall-s`, 503
    otherwise (the gRPC health service says the same)."""
    ctx = serving(request)
    if ctx.engine.is_responsive(ctx.config.engine_stall_s):
        return Response(status_code=200)
    return json_response(error_body("the engine is not responsive (dead, or one step or "
                                    "command has run too long)", 503), 503)


@router.get("/version")
async def version(request: Request) -> Response:
    try:
        number = metadata.version("rollout-engine")
    except metadata.PackageNotFoundError:
        number = "unknown"
    return json_response({"version": number})


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    ctx = serving(request)
    cards = [{"id": name, "object": "model", "created": _CREATED_S, "owned_by": "rollout-engine",
              "root": ctx.engine.model.model, "parent": None,
              "max_model_len": ctx.max_model_len, "permission": []}
             for name in ctx.served_model_names]
    if ctx.engine.model.config.lora_config.enable_lora:
        cards += [{"id": lora.lora_name, "object": "model", "created": _CREATED_S,
                   "owned_by": "rollout-engine", "root": lora.lora_path or None,
                   "parent": ctx.model_name, "max_model_len": ctx.max_model_len,
                   "permission": []}
                  for lora in await ctx.engine.lora_adapters()]
    return json_response({"object": "list", "data": cards})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    ctx = serving(request)
    snapshot = await ctx.engine.metrics()
    text = (prometheus_text(ctx, snapshot.info, snapshot.is_paused)
            + ctx.metrics.render(snapshot.info, snapshot.request_stats))
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def prometheus_text(ctx: ServingContext, info: EngineInfo, is_paused: bool) -> str:
    used = info.num_blocks - info.num_free_blocks
    stats = info.engine_stats
    families = [
        ("requests_total", "counter", "Prompts added since start (gRPC and HTTP).",
         info.num_requests_total),
        ("generated_tokens_total", "counter", "Tokens of the completions finished since start.",
         info.num_generated_tokens_total),
        ("preemptions_total", "counter", "Requests preempted for KV blocks since start.",
         stats.get("num_preemptions", 0)),
        ("prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens served from the prefix cache since start.",
         stats.get("num_prefix_hit_tokens", 0)),
        ("inflight_requests", "gauge", "Samples admitted and not yet answered.",
         info.num_inflight_requests),
        ("max_inflight_requests", "gauge", "The admission limit, in samples.",
         info.max_inflight_requests),
        ("unfinished_requests", "gauge", "Prompts the engine holds (running or waiting).",
         info.num_unfinished_requests),
        ("kv_cache_blocks", "gauge", "KV cache blocks in all.", info.num_blocks),
        ("kv_cache_free_blocks", "gauge", "KV cache blocks free.", info.num_free_blocks),
        ("kv_cache_usage_ratio", "gauge", "Fraction of the KV cache blocks in use.",
         used / info.num_blocks if info.num_blocks else 0.0),
        ("is_sleeping", "gauge", "1 while any memory pool is released.", int(info.is_sleeping)),
        ("weights_valid", "gauge", "0 after sleep level 2 or a cut-off weight update.",
         int(info.weights_valid)),
        ("is_paused", "gauge", "1 while generation is paused.", int(is_paused)),
        ("weight_version", "gauge", "Weight updates landed since start.", info.weight_version),
    ]
    if "spec_num_drafts" in stats:  # speculative decoding on
        families += [
            ("spec_accept_rate", "gauge", "Draft tokens accepted / verified since start.",
             stats["spec_acceptance_rate"]),
            ("spec_mean_accepted_length", "gauge",
             "Tokens gained per drafting step since start (accepted drafts + 1).",
             stats["spec_mean_accepted_length"]),
        ]
    label = f'{{model_name="{_escape(ctx.model_name)}"}}'
    lines = []
    for name, kind, help_text, value in families:
        lines += [f"# HELP rollout_engine_{name} {help_text}",
                  f"# TYPE rollout_engine_{name} {kind}",
                  f"rollout_engine_{name}{label} {_number(value)}"]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, float) and not value.is_integer():
        return repr(value)
    return str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
