"""Tensor parallelism over 2 CPU processes (gloo): same tokens as one process and as
transformers, and sleep, wake and weight updates applied on every rank."""

from __future__ import annotations

import multiprocessing

import pytest
from safetensors.torch import load_file
from transformers import AutoConfig

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import WeightUpdateError
from rollout_engine.tiny_model import build_tiny_model
from tests.conftest import ARCHS
from tests.integration.hf_oracle import hf_greedy_batch

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42], list(range(20, 52)), [300, 301]]
MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
OPTIONS = {"kv_cache_bytes": 1 << 20, "block_size": 4, "cpu_threads": 1}


@pytest.fixture(scope="module")
def tp_engines(tiny_model_dirs):
    """One TP=2 engine per architecture, started when first needed, shut down at the end."""
    engines: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in engines:
            engines[arch] = LLM(str(tiny_model_dirs[arch]), tensor_parallel_size=2, **OPTIONS)
        return engines[arch]

    yield get
    for llm in engines.values():
        llm.shutdown()


def run(llm: LLM, prompts: list[list[int]] = PROMPTS):
    return [output.outputs[0] for output in llm.generate(prompts, GREEDY)]


def tag_states(state) -> dict[str, tuple[str, bool]]:
    return {tag: (entry.state, entry.mapped) for tag, entry in state.tags.items()}


def test_tiny_presets_split_real_gqa_kv_heads(tiny_model_dirs):
    for arch in ARCHS:
        config = AutoConfig.from_pretrained(tiny_model_dirs[arch])
        # Grouped-query attention, with a KV head per rank at TP=2: the split is real.
        assert 2 <= config.num_key_value_heads < config.num_attention_heads


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_equals_tp1_and_transformers(tiny_model_dirs, tp_engines, arch):
    model_dir = str(tiny_model_dirs[arch])
    single = run(LLM(model_dir, **OPTIONS))
    sharded = run(tp_engines(arch))
    expected = hf_greedy_batch(model_dir, PROMPTS, MAX_NEW_TOKENS)
    assert [c.token_ids for c in sharded] == [c.token_ids for c in single] == expected
    for one, two in zip(single, sharded):
        assert max(abs(a - b) for a, b in zip(one.logprobs, two.logprobs)) < 1e-4
    # Each rank's KV cache holds its own KV head only: half the bytes per block.
    worker = tp_engines(arch).engine.worker
    num_kv_heads = AutoConfig.from_pretrained(model_dir).num_key_value_heads
    assert worker.kv_spec.num_kv_heads == num_kv_heads // 2


def test_sleep_level1_and_wake_up_on_every_rank_give_the_same_tokens(tp_engines):
    llm = tp_engines("llama")
    reference = [c.token_ids for c in run(llm)]
    addresses = (llm.weight_ptrs(), llm.kv_cache_ptr())
    llm.sleep(level=1)
    asleep = {"weights": ("offloaded", False), "kv_cache": ("discarded", False)}
    assert [tag_states(s) for s in llm.engine.worker.rank_memory_states()] == [asleep, asleep]
    llm.wake_up()
    awake = {"weights": ("awake", True), "kv_cache": ("awake", True)}
    assert [tag_states(s) for s in llm.engine.worker.rank_memory_states()] == [awake, awake]
    assert [c.token_ids for c in run(llm)] == reference
    assert (llm.weight_ptrs(), llm.kv_cache_ptr()) == addresses


def test_sleep_level2_then_full_weight_update_gives_the_same_tokens(tp_engines, llama_dir):
    llm = tp_engines("llama")
    reference = [c.token_ids for c in run(llm)]
    version = llm.weight_version
    llm.sleep(level=2)
    llm.wake_up(["weights"])
    discarded = {"weights": ("discarded", True), "kv_cache": ("discarded", False)}
    assert [tag_states(s) for s in llm.engine.worker.rank_memory_states()] == [discarded] * 2
    # Full checkpoint-shaped tensors, as a trainer sends them; each rank keeps its shard.
    assert llm.update_weights(load_file(str(llama_dir / "model.safetensors"))) == version + 1
    llm.wake_up(["kv_cache"])
    outputs = run(llm)
    assert [c.token_ids for c in outputs] == reference
    assert all(c.weight_version == version + 1 for c in outputs)
    assert all(s.weights_valid for s in llm.engine.worker.rank_memory_states())


def test_release_kv_cache_memory_and_wake_up_on_every_rank(tp_engines):
    llm = tp_engines("llama")
    reference = [c.token_ids for c in run(llm)]
    llm.release_kv_cache_memory()
    states = llm.engine.worker.rank_memory_states()
    assert [tag_states(s)["kv_cache"] for s in states] == [("discarded", False)] * 2
    llm.wake_up(["kv_cache"])
    assert [c.token_ids for c in run(llm)] == reference


def test_weight_update_session_checks_full_shapes_and_shards_on_receipt(
    tp_engines, tiny_model_dirs
):
    llm = tp_engines("qwen2")  # tied embeddings, q/k/v biases
    reference = [c.token_ids for c in run(llm)]
    weights = load_file(str(tiny_model_dirs["qwen2"] / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    half = weights[name][: weights[name].shape[0] // 2]  # one rank's shard is not an update
    refused = r"the update has shape \[16, 64\], the model has \[32, 64\]"
    with pytest.raises(WeightUpdateError, match=refused):
        llm.begin_weight_update([(name, tuple(half.shape), half.dtype)])
    session = llm.begin_weight_update([(n, tuple(t.shape), t.dtype) for n, t in weights.items()])
    for n, t in weights.items():
        session.write(n, t)
    session.finish()
    assert [c.token_ids for c in run(llm)] == reference


def test_refused_configurations_start_no_process(llama_dir):
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        LLM(str(llama_dir), tensor_parallel_size=3, **OPTIONS)
    for option in ({"async_scheduling": True}, {"cuda_graphs": True}, {"kv_role": "both"}):
        (name,) = option
        with pytest.raises(ValueError, match=f"{name}.*not supported with tensor_parallel"):
            LLM(str(llama_dir), tensor_parallel_size=2, **option, **OPTIONS)
    assert set(multiprocessing.active_children()) == children


def test_tp1_starts_no_process_and_no_group(llama_dir):
    children = set(multiprocessing.active_children())
    llm = LLM(str(llama_dir), **OPTIONS)
    run(llm)
    assert llm.engine.worker.tp.process_group is None
    assert set(multiprocessing.active_children()) == children


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path):
    # One KV head (multi-query attention) over 2 ranks: both ranks hold a copy of it.
    model_dir = str(build_tiny_model(tmp_path / "mqa", "llama", "tiny", num_key_value_heads=1))
    llm = LLM(model_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        assert llm.engine.worker.kv_spec.num_kv_heads == 1
        sharded = run(llm)
    finally:
        llm.shutdown()
    expected = hf_greedy_batch(model_dir, PROMPTS, MAX_NEW_TOKENS)
    assert [c.token_ids for c in sharded] == expected


def test_speculative_decoding_under_tp_gives_the_same_tokens(llama_dir):
    repetitive = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], *PROMPTS]
    reference = run(LLM(str(llama_dir), **OPTIONS), repetitive)
    llm = LLM(str(llama_dir), tensor_parallel_size=2, num_speculative_tokens=3, **OPTIONS)
    try:
        drafted = run(llm, repetitive)
        assert llm.stats()["spec_num_drafts"] > 0
    finally:
        llm.shutdown()
    assert [c.token_ids for c in drafted] == [c.token_ids for c in reference]
