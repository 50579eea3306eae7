"""What an engine reports about itself: its counters (`stats`) and its description (`info`)."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from rollout_engine.protocol import EngineInfo

if TYPE_CHECKING:
    from rollout_engine.engine.llm_engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict[str, float]:
    """Counters: KV blocks, requests running and waiting, preemptions, prefix-cache queries
    and hits, prompt and generated tokens, finished requests, speculative decoding, KV
    transfers."""
    scheduler = engine.scheduler
    stats: dict[str, float] = {
        "weight_version": engine.weight_version,
        "num_unfinished_requests": engine.num_unfinished_requests,
        "num_blocks": scheduler.num_blocks,
        "num_free_blocks": scheduler.num_free_blocks,
        "num_preemptions": scheduler.num_preemptions,
        "num_prefix_hit_tokens": scheduler.num_prefix_hit_tokens,
        "num_running_requests": scheduler.num_running_requests,
        "num_waiting_requests": len(scheduler.waiting),
        **engine.output_processor.stats.counters(),
    }
    if engine.drafter is not None:
        stats.update({f"spec_{k}": v for k, v in engine.drafter.stats.as_dict().items()})
        if engine.drafter.suffix is not None:
            stats["spec_suffix_cached_tokens"] = engine.drafter.suffix.num_cached_tokens
            stats["spec_suffix_prompts"] = engine.drafter.suffix.num_prompts
    if engine.kv_connector is not None:
        stats.update(engine.kv_connector.stats())
    return stats


def engine_info(engine: LLMEngine) -> EngineInfo:
    """What the engine is and how it is doing, as the server and clients see it."""
    config, limits, memory = engine.config, engine.limits, engine.memory_state()
    return EngineInfo(
        model=config.model_config.model,
        architecture=(getattr(engine.hf_config, "architectures", None) or [""])[0],
        vocab_size=limits.vocab_size,
        max_model_len=limits.max_model_len,
        dtype=str(engine.worker.dtype).removeprefix("torch."),
        device=str(engine.device),
        weight_version=engine.weight_version,
        config_json=json.dumps(dataclasses.asdict(config), default=str, sort_keys=True),
        num_blocks=engine.scheduler.num_blocks,
        num_free_blocks=engine.scheduler.num_free_blocks,
        block_size=config.cache_config.block_size,
        eos_token_ids=list(limits.eos_token_ids),
        is_sleeping=memory.is_sleeping,
        weights_valid=memory.weights_valid,
        engine_stats={k: float(v) for k, v in engine.stats().items()},
        num_unfinished_requests=engine.num_unfinished_requests,
    )
