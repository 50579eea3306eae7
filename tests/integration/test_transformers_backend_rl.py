"""The transformers backend through the RL loop, for a MoE family (Qwen3-MoE: one tensor per
expert in the checkpoint, fused ones in the module) and a sliding-window one (Gemma 3: sliding
and full layers alternating): sleep with measured memory, weights from a trainer's
`named_parameters()`, seeded sampling and speculative decoding."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import write_model_dir
from tests.integration.hf_oracle import hf_greedy, hf_logprobs, load_hf_model
from tests.integration.test_sleep_wake import scenario_result, start_scenario
from tests.integration.test_spec_decode import repetitive_prompts
from tests.integration.test_transformers_backend import (
    CONFIGS,
    ENGINE_OPTIONS,
    LOGPROB_ATOL,
    MAX_NEW_TOKENS,
    PREEMPTING_OPTIONS,
    PROMPTS,
    greedy_tokens,
    make_config,
)

if TYPE_CHECKING:
    from rollout_engine import RequestOutput

FAMILIES = ("qwen3_moe", "gemma3_text")
# Sizes at which the pools (weights over 50 MB, next to the scenarios' 64 MiB KV pool)
# dominate the noise of resident memory.
SLEEP_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {
        **CONFIGS["qwen3_moe"][1], "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "num_experts": 8,
        "moe_intermediate_size": 768,
    }),
    "gemma3_text": ("Gemma3TextConfig", {
        **CONFIGS["gemma3_text"][1], "hidden_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
        "intermediate_size": 2048, "layer_types": ["sliding_attention", "full_attention"] * 2,
    }),
}
SEEDED = SamplingParams(n=2, temperature=1.0, seed=123, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
UNSEEDED = SamplingParams(n=2, temperature=0.8, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
NUM_SPECULATIVE_TOKENS = 3
SPEC_PROMPTS = repetitive_prompts(num_prompts=6, seed=2)
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir_of(tmp_path_factory) -> Callable[..., str]:
    """family, seed -> a directory of the family's small model (CONFIGS), written once."""
    root = tmp_path_factory.mktemp("rl_models")
    written: dict[tuple[str, int], str] = {}

    def model_dir(family: str, seed: int = 0) -> str:
        if (family, seed) not in written:
            config = make_config(*CONFIGS[family])
            written[family, seed] = str(write_model_dir(root / f"{family}-{seed}", config, seed))
        return written[family, seed]

    return model_dir


def samples(output: RequestOutput) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of each of a request's samples."""
    return [(completion.token_ids, completion.logprobs) for completion in output.outputs]


def assert_hf_logprobs(model_dir: str, prompt: list[int], output: RequestOutput) -> None:
    """Each sample's logprobs are log_softmax of HF's logits at its tokens (temperature 1)."""
    for tokens, logprobs in samples(output):
        expected = hf_logprobs(model_dir, prompt, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=LOGPROB_ATOL)


# ---------------------------------------------------------------------- measured memory
@pytest.fixture(scope="module")
def sleep_result(tmp_path_factory) -> Iterator[Callable[[str], dict[str, Any]]]:
    """family -> what `levels_from_trainer` of sleep_scenarios.py measured in its own fresh
    interpreter; both families' scenarios run at once."""
    root = tmp_path_factory.mktemp("sleep_models")
    processes: dict[str, subprocess.Popen[str]] = {}
    for family, (config_class, kwargs) in SLEEP_CONFIGS.items():
        model_dir = write_model_dir(root / family, make_config(config_class, kwargs))
        processes[family] = start_scenario("levels_from_trainer", model_dir)
    results: dict[str, dict[str, Any]] = {}

    def result(family: str) -> dict[str, Any]:
        if family not in results:
            results[family] = scenario_result(processes[family])
        return results[family]

    yield result
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("family", FAMILIES)
def test_level1_releases_the_kv_pool_and_keeps_the_weights_in_a_host_backup(sleep_result, family):
    result = sleep_result(family)
    level1, pool_bytes = result["level1"], result["pool_bytes"]
    kv_bytes, weights_bytes = pool_bytes["kv_cache"], pool_bytes["weights"]
    assert result["model_impl"] == "transformers" and weights_bytes > 50 << 20, result
    released = level1["rss_awake"] - level1["rss_asleep"]
    # On the CPU the backup is host memory too: only the KV pool leaves resident memory.
    assert 0.95 * kv_bytes <= released < kv_bytes + 0.05 * weights_bytes, result
    assert level1["rss_woken"] - level1["rss_asleep"] >= 0.95 * kv_bytes, result
    assert level1["states_asleep"] == {"weights": "offloaded", "kv_cache": "discarded"}, result
    assert level1["same_outputs"] and level1["same_addresses"], result


@pytest.mark.parametrize("family", FAMILIES)
def test_level2_releases_both_pools_and_a_trainers_named_parameters_fill_them(
    sleep_result, family
):
    result = sleep_result(family)
    level2, pool_bytes = result["level2"], sum(result["pool_bytes"].values())
    assert result["model_impl"] == "transformers" and result["pool_bytes"]["weights"] > 50 << 20
    assert level2["rss_awake"] - level2["rss_asleep"] >= 0.95 * pool_bytes, result
    assert level2["rss_woken"] - level2["rss_asleep"] >= 0.95 * pool_bytes, result
    assert level2["states_asleep"] == {"weights": "discarded", "kv_cache": "discarded"}, result
    assert level2["states_woken"] == {"weights": "awake", "kv_cache": "awake"}, result
    assert level2["weight_version"] == 1, result
    assert level2["same_outputs"] and level2["same_addresses"], result
    if family == "qwen3_moe":  # the trainer's names are the fused ones, not the checkpoint's
        assert any("experts.gate_up_proj" in name for name in result["trainer_parameter_names"])


# ---------------------------------------------------------------------- weights and sampling
def test_a_sliding_window_model_takes_a_trainers_named_parameters(model_dir_of):
    """Gemma 3 (Qwen3-MoE: see test_transformers_backend.py): a second checkpoint's weights,
    sent as its HF model's `named_parameters()` (the tied embedding once), give its tokens."""
    llm = LLM(model_dir_of("gemma3_text"), model_impl="transformers", **ENGINE_OPTIONS)
    new_dir = model_dir_of("gemma3_text", seed=1)
    expected = [hf_greedy(new_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    assert greedy_tokens(llm, PROMPTS) != expected
    assert llm.update_weights(load_hf_model(new_dir).named_parameters()) == 1
    assert greedy_tokens(llm, PROMPTS) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_samples_do_not_depend_on_the_batch_or_preemption(model_dir_of, family):
    """The same seeded request alone, after unseeded ones, and after them on too few KV blocks
    (preempted and recomputed): the same tokens, with HF's logprobs."""
    model_dir = model_dir_of(family)
    target = PROMPTS[1]
    # The newest request is the first preempted: the seeded one, last here.
    batch_prompts, batch_params = [PROMPTS[2], PROMPTS[0], target], [UNSEEDED, UNSEEDED, SEEDED]
    llm = LLM(model_dir, model_impl="transformers", **ENGINE_OPTIONS)
    (alone,) = llm.generate([target], SEEDED)
    batched = llm.generate(batch_prompts, batch_params)[-1]
    preempting = LLM(model_dir, model_impl="transformers", **PREEMPTING_OPTIONS)
    preempted = preempting.generate(batch_prompts, batch_params)[-1]
    assert preempting.stats()["num_preemptions"] > 0
    tokens = [token_ids for token_ids, _ in samples(alone)]
    assert tokens[0] != tokens[1]  # the two samples of the request differ
    assert [token_ids for token_ids, _ in samples(batched)] == tokens
    assert [token_ids for token_ids, _ in samples(preempted)] == tokens
    for output in (alone, batched, preempted):
        assert_hf_logprobs(model_dir, target, output)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_keeps_hf_greedy_tokens_and_the_logprobs(model_dir_of, family):
    """N-gram drafts over prompts that repeat themselves, proposed and accepted: HF's greedy
    tokens, and the logprobs the engine gives without speculation."""
    model_dir = model_dir_of(family)
    expected = [hf_greedy(model_dir, prompt, SPEC_GREEDY.max_tokens) for prompt in SPEC_PROMPTS]
    plain = LLM(model_dir, model_impl="transformers").generate(SPEC_PROMPTS, SPEC_GREEDY)
    llm = LLM(model_dir, model_impl="transformers", num_speculative_tokens=NUM_SPECULATIVE_TOKENS)
    speculated = llm.generate(SPEC_PROMPTS, SPEC_GREEDY)
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert [output.outputs[0].token_ids for output in speculated] == expected
    for with_drafts, without in zip(speculated, plain):
        logprobs = [torch.tensor(output.outputs[0].logprobs) for output in (with_drafts, without)]
        torch.testing.assert_close(*logprobs, rtol=0, atol=LOGPROB_ATOL)
