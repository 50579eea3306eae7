"""Engine sleep/wake scenarios run in a fresh interpreter each, so that measured memory is clean.

Resident memory ("rss_*") is private resident memory (tests/memory_growth.py): the pools and the
heap, not the library pages that the kernel drops under memory pressure and faults back in (some
MB, at any time: more than the 5% bounds allow).

Usage: python tests/integration/sleep_scenarios.py NAME MODEL_DIR; prints one JSON object.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from memory import process_rss_bytes
from rollout_engine import LLM, SamplingParams
from tests.memory_growth import private_rss_bytes

MiB = 1 << 20
KV_CACHE_BYTES = 64 * MiB
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 3, 42], list(range(20, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# One intra-op thread: on a loaded machine, spinning OpenMP workers slow small ops a lot.
torch.set_num_threads(1)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _addresses(llm: LLM) -> tuple[dict[str, int], int]:
    return llm.weight_ptrs(), llm.kv_cache_ptr()


def _tag_states(llm: LLM) -> dict[str, str]:
    return {tag: entry.state for tag, entry in llm.memory_state().tags.items()}


def level2(model_dir: str) -> dict[str, Any]:
    """sleep(level=2) releases both pools; weights come back only through update_weights."""
    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    before, addresses = greedy_tokens(llm), _addresses(llm)
    rss_awake = private_rss_bytes()
    llm.sleep(level=2)
    rss_asleep, states_asleep = private_rss_bytes(), _tag_states(llm)
    llm.wake_up(["weights"])
    weights = checkpoint(model_dir)
    version = llm.update_weights(weights)
    del weights
    gc.collect()
    llm.wake_up(["kv_cache"])
    rss_woken = private_rss_bytes()
    return {
        "pool_bytes": llm.memory_state().pool_bytes,
        "rss_awake": rss_awake,
        "rss_asleep": rss_asleep,
        "rss_woken": rss_woken,
        "states_asleep": states_asleep,
        "states_woken": _tag_states(llm),
        "weight_version": version,
        "same_outputs": greedy_tokens(llm) == before,
        "same_addresses": _addresses(llm) == addresses,
    }


def release_kv(model_dir: str) -> dict[str, Any]:
    """release_kv_cache_memory() releases the KV pool only; wake_up(["kv_cache"]) brings it back."""
    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    before, addresses = greedy_tokens(llm), _addresses(llm)
    rss_awake = private_rss_bytes()
    llm.release_kv_cache_memory()
    rss_released, states_released = private_rss_bytes(), _tag_states(llm)
    llm.wake_up(["kv_cache"])
    rss_woken = private_rss_bytes()
    return {
        "pool_bytes": llm.memory_state().pool_bytes,
        "rss_awake": rss_awake,
        "rss_released": rss_released,
        "rss_woken": rss_woken,
        "states_released": states_released,
        "same_outputs": greedy_tokens(llm) == before,
        "same_addresses": _addresses(llm) == addresses,
    }


def level1(model_dir: str) -> dict[str, Any]:
    """sleep(level=1) keeps the weights in a host backup and releases the KV pool."""
    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    before, addresses = greedy_tokens(llm), _addresses(llm)
    rss_awake = private_rss_bytes()
    llm.sleep(level=1)
    rss_asleep, states_asleep = private_rss_bytes(), _tag_states(llm)
    llm.wake_up()
    return {
        "pool_bytes": llm.memory_state().pool_bytes,
        "rss_awake": rss_awake,
        "rss_asleep": rss_asleep,
        "rss_woken": private_rss_bytes(),
        "states_asleep": states_asleep,
        "same_outputs": greedy_tokens(llm) == before,
        "same_addresses": _addresses(llm) == addresses,
    }


def _measured_sleep(llm: LLM, level: int) -> dict[str, Any]:
    rss_awake = private_rss_bytes()
    llm.sleep(level=level)
    return {"rss_awake": rss_awake, "rss_asleep": private_rss_bytes(),
            "states_asleep": _tag_states(llm)}


def levels_from_trainer(model_dir: str) -> dict[str, Any]:
    """Level 1, then level 2 with the weights back from a colocated trainer's model: its
    `named_parameters()`, whose names (a MoE's fused experts) are not the checkpoint's.

    Both levels in one process, as a model's load costs far more than its measurement: on
    the CPU, level 1's wake-up closes its backup, so level 2 starts from the same footprint.
    The trainer's model is loaded first, so that the measured deltas are the engine's own.
    """
    from transformers import AutoModelForCausalLM  # only here: the other scenarios never load it

    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    before, addresses = greedy_tokens(llm), _addresses(llm)
    gc.collect()
    level1 = _measured_sleep(llm, level=1)
    llm.wake_up()
    level1 |= {"rss_woken": private_rss_bytes(), "same_outputs": greedy_tokens(llm) == before,
               "same_addresses": _addresses(llm) == addresses}
    level2 = _measured_sleep(llm, level=2)
    llm.wake_up(["weights"])
    level2["weight_version"] = llm.update_weights(trainer_model.named_parameters())
    llm.wake_up(["kv_cache"])
    level2 |= {"rss_woken": private_rss_bytes(), "states_woken": _tag_states(llm),
               "same_outputs": greedy_tokens(llm) == before,
               "same_addresses": _addresses(llm) == addresses}
    return {
        "pool_bytes": llm.memory_state().pool_bytes,
        "model_impl": llm.engine.worker.model_impl,
        "trainer_parameter_names": [name for name, _ in trainer_model.named_parameters()],
        "level1": level1,
        "level2": level2,
    }


def _cycle(llm: LLM, weights: dict[str, torch.Tensor], step: int) -> None:
    """Level 1 on even steps; level 2 + a full update on odd ones (the RL choreography)."""
    if step % 2 == 0:
        llm.sleep(level=1)
        llm.wake_up()
        return
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    llm.update_weights(weights)
    llm.wake_up(["kv_cache"])


def cycles(model_dir: str, num_cycles: int = 500) -> dict[str, Any]:
    """Many sleep/wake cycles of both levels; resident memory must not grow. It is measured
    after the warm-up, half-way and at the end, each time awake and right after a generation
    (see tests/memory_growth.py)."""
    # A short timeline: it is a bounded log, and a full one keeps a constant size.
    llm = LLM(model_dir, kv_cache_bytes=1 * MiB, timeline_max_events=100)
    weights = checkpoint(model_dir)
    before, addresses = greedy_tokens(llm), _addresses(llm)
    for step in range(40):  # warm-up: first-use allocations of torch and Python
        _cycle(llm, weights, step)
    greedy_tokens(llm)  # measured awake, as at the end (CPU linears packed again)
    gc.collect()
    rss_before, private_rss = process_rss_bytes(), [private_rss_bytes()]
    num_same_outputs = 0
    for step in range(num_cycles):
        _cycle(llm, weights, step)
        if step % 50 == 49:
            num_same_outputs += greedy_tokens(llm) == before
        if step + 1 in (num_cycles // 2, num_cycles):
            gc.collect()
            private_rss.append(private_rss_bytes())
    return {
        "num_cycles": num_cycles,
        "num_checks": num_cycles // 50,
        "num_same_outputs": num_same_outputs,
        "private_rss_bytes": private_rss,
        "rss_before": rss_before,
        "rss_after": process_rss_bytes(),
        "weight_version": llm.weight_version,
        "same_addresses": _addresses(llm) == addresses,
    }


def shutdown(model_dir: str) -> dict[str, Any]:
    """shutdown() frees both pools for good; an engine dropped without it frees them when it is
    collected (driver memory, unlike these mappings, is never reclaimed by the collector: the
    manager is held here so that only the engine's own finalizer can free the pools)."""
    llm = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    greedy_tokens(llm)
    pool_bytes, rss_awake = llm.memory_state().pool_bytes, private_rss_bytes()
    llm.shutdown()
    rss_shut = private_rss_bytes()
    try:
        llm.generate(PROMPTS, GREEDY)
        error_after_shutdown = None
    except Exception as exc:  # noqa: BLE001 - the type is the result
        error_after_shutdown = type(exc).__name__
    del llm
    dropped = LLM(model_dir, kv_cache_bytes=KV_CACHE_BYTES)
    greedy_tokens(dropped)
    manager, rss_dropped_awake = dropped.engine.worker.memory.manager, private_rss_bytes()
    del dropped
    gc.collect()
    return {
        "pool_bytes": pool_bytes,
        "rss_awake": rss_awake,
        "rss_shut": rss_shut,
        "error_after_shutdown": error_after_shutdown,
        "rss_dropped_awake": rss_dropped_awake,
        "rss_dropped": private_rss_bytes(),
        "tags_after_drop": manager.tags(),
    }


SCENARIOS: dict[str, Callable[[str], dict[str, Any]]] = {
    "level2": level2,
    "release_kv": release_kv,
    "level1": level1,
    "levels_from_trainer": levels_from_trainer,
    "cycles": cycles,
    "shutdown": shutdown,
}


if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](sys.argv[2])))
