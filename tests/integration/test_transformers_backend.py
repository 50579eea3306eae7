"""The transformers backend (`model_impl="transformers"`): Hugging Face's modeling code over our
paged KV cache gives HF `generate`'s greedy tokens, and what it cannot run exactly is refused."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import ModelLoadError
from rollout_engine.tiny_model import BOS_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, write_model_dir
from rollout_engine.worker.models.loader import iterate_checkpoint
from rollout_engine.worker.models.packed_linear import PackedModuleLinears
from rollout_engine.worker.models.transformers_backend import TransformersForCausalLM
from tests.integration.hf_oracle import hf_greedy, load_hf_model

MAX_NEW_TOKENS = 12
VOCAB_SIZE = 512
SPECIAL_IDS = {
    "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    "pad_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
}
# Llama-style sizes; each entry below names its config class's own fields where they differ.
LLAMA_LIKE = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 256, "initializer_range": 0.1, **SPECIAL_IDS,
}
GPT2_LIKE = {
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": VOCAB_SIZE,
    "initializer_range": 0.1, **SPECIAL_IDS,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # model type -> (config class, its arguments)
    "llama": ("LlamaConfig", LLAMA_LIKE),
    "mistral": ("MistralConfig", {**LLAMA_LIKE, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", {**LLAMA_LIKE, "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {**LLAMA_LIKE, "head_dim": 16}),
    "gemma": ("GemmaConfig", {**LLAMA_LIKE, "head_dim": 16}),
    "gemma3_text": ("Gemma3TextConfig", {
        **LLAMA_LIKE, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 5.0,
    }),
    "phi3": ("Phi3Config", LLAMA_LIKE),
    "olmo2": ("Olmo2Config", LLAMA_LIKE),
    "granite": ("GraniteConfig", {**LLAMA_LIKE, "logits_scaling": 2.0, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "attention_multiplier": 0.2}),
    "glm4": ("Glm4Config", {**LLAMA_LIKE, "head_dim": 16}),
    "starcoder2": ("Starcoder2Config", {**LLAMA_LIKE, "sliding_window": 8}),
    "cohere": ("CohereConfig", {**LLAMA_LIKE, "logit_scale": 0.5}),
    "stablelm": ("StableLmConfig", LLAMA_LIKE),
    "smollm3": ("SmolLM3Config", LLAMA_LIKE),
    "phi": ("PhiConfig", LLAMA_LIKE),
    "olmo": ("OlmoConfig", LLAMA_LIKE),
    "olmo3": ("Olmo3Config", {**LLAMA_LIKE, "sliding_window": 8}),
    "nemotron": ("NemotronConfig", LLAMA_LIKE),
    "helium": ("HeliumConfig", {**LLAMA_LIKE, "head_dim": 16}),
    "exaone4": ("Exaone4Config", {**LLAMA_LIKE, "sliding_window": 8}),
    "arcee": ("ArceeConfig", LLAMA_LIKE),
    # MoE: transformers fuses the checkpoint's per-expert tensors on load.
    "mixtral": ("MixtralConfig", {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {**LLAMA_LIKE, **MOE, "shared_expert_intermediate_size": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", {**LLAMA_LIKE, **MOE, "head_dim": 16}),
    "gpt2": ("GPT2Config", GPT2_LIKE),
    "gptj": ("GPTJConfig", {**GPT2_LIKE, "rotary_dim": 8}),
    "codegen": ("CodeGenConfig", {**GPT2_LIKE, "rotary_dim": 8, "n_ctx": 256}),
    "gpt_neox": ("GPTNeoXConfig", {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 256,
        "rotary_pct": 0.5, "initializer_range": 0.1, **SPECIAL_IDS,
    }),
    "opt": ("OPTConfig", {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 128,
        "word_embed_proj_dim": 64, "vocab_size": VOCAB_SIZE, "max_position_embeddings": 256,
        "init_std": 0.1, "initializer_range": 0.1, **SPECIAL_IDS,
    }),
}
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    # model type -> (config class, its arguments, what the error says)
    "falcon": ("FalconConfig", {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": VOCAB_SIZE, **SPECIAL_IDS,
    }, "does not go through transformers' AttentionInterface"),
    "gpt_neo": ("GPTNeoConfig", {
        "hidden_size": 64, "num_layers": 2, "num_heads": 4, "attention_types": [[["global"], 2]],
        "max_position_embeddings": 256, "vocab_size": VOCAB_SIZE, **SPECIAL_IDS,
    }, "does not go through transformers' AttentionInterface"),
    "bloom": ("BloomConfig", {"hidden_size": 64, "n_layer": 2, "n_head": 4,
                              "vocab_size": VOCAB_SIZE, **SPECIAL_IDS}, "ALiBi"),
    "llama4_text": ("Llama4TextConfig", {**LLAMA_LIKE, "head_dim": 16}, "chunked_attention"),
    "jamba": ("JambaConfig", {**LLAMA_LIKE, "num_experts": 2, "expert_layer_period": 2,
                              "attn_layer_period": 2, "attn_layer_offset": 1},
              "recurrent or hybrid"),
    "gemma2": ("Gemma2Config", {**LLAMA_LIKE, "head_dim": 16}, "attention logit softcapping"),
}


def make_prompts(seed: int = 0) -> list[list[int]]:
    """Three prompts longer than the sliding windows (8) and than a chunk (8 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB_SIZE) for _ in range(length)] for length in (5, 19, 27)]


PROMPTS = make_prompts()
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# Chunked prefill (8-token budget) and prefix caching (the n=2 siblings and the repeated
# prompt hit the first one's blocks).
ENGINE_OPTIONS = {"max_num_batched_tokens": 8, "block_size": 4, "num_blocks": 128,
                  "enable_prefix_caching": True}


def make_config(config_class: str, kwargs: dict[str, Any]):
    return getattr(transformers, config_class)(**kwargs)


@pytest.fixture(scope="module")
def model_dir_of(tmp_path_factory) -> Callable[..., str]:
    """model type (of CONFIGS or REFUSED), seed -> a model directory, written once."""
    root = tmp_path_factory.mktemp("backend_models")
    written: dict[tuple[str, int], str] = {}

    def model_dir(model_type: str, seed: int = 0) -> str:
        if (model_type, seed) not in written:
            config_class, kwargs = (CONFIGS.get(model_type) or REFUSED[model_type])[:2]
            path = root / f"{model_type}-{seed}"
            config = make_config(config_class, kwargs)
            written[model_type, seed] = str(write_model_dir(path, config, seed))
        return written[model_type, seed]

    return model_dir


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The first sample's tokens per prompt; both of each prompt's samples must agree."""
    tokens = []
    for output in llm.generate(prompts, GREEDY):
        first, second = (o.token_ids for o in output.outputs)
        assert first == second, "the n=2 greedy samples of one prompt differ"
        tokens.append(first)
    return tokens


def backend_model(llm: LLM) -> TransformersForCausalLM:
    model = llm.engine.worker.model_runner.model
    assert isinstance(model, TransformersForCausalLM), type(model)
    return model


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_greedy_matches_transformers(model_dir_of, model_type):
    model_dir = model_dir_of(model_type)
    prompts = [*PROMPTS, PROMPTS[2]]  # the repeated prompt hits the prefix cache
    expected = [hf_greedy(model_dir, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm = LLM(model_dir, model_impl="transformers", **ENGINE_OPTIONS)
    assert greedy_tokens(llm, prompts) == expected
    packed = llm.engine.worker.packed_weights  # CPU: HF's nn.Linear modules ran packed
    assert packed.is_packed and (packed.num_bytes > 0) == bool(packed.linears)
    assert llm.engine.scheduler.num_prefix_hit_tokens > 0
    # Buffers (RoPE's inv_freq, embedding scales) equal those from_pretrained computes.
    hf_buffers = dict(load_hf_model(model_dir).named_buffers())
    for name, buffer in backend_model(llm).named_buffers():
        assert torch.equal(buffer, hf_buffers[name]), name


def test_auto_picks_native_for_native_architectures_and_transformers_for_others(model_dir_of):
    llm = LLM(model_dir_of("llama"), num_blocks=16)
    assert llm.engine.worker.model_impl == "native"
    llm = LLM(model_dir_of("gpt2"), num_blocks=16)
    assert llm.engine.worker.model_impl == "transformers"
    # CPU: HF's own nn.Linear modules run on packed copies, one by one.
    assert isinstance(llm.engine.worker.packed_weights, PackedModuleLinears)


def test_native_refuses_an_architecture_it_does_not_have(model_dir_of):
    with pytest.raises(ModelLoadError, match="no native implementation"):
        LLM(model_dir_of("gpt2"), model_impl="native")


def test_tensor_parallelism_is_refused(model_dir_of):
    with pytest.raises(ValueError, match="does not split models yet"):
        LLM(model_dir_of("gpt2"), tensor_parallel_size=2)


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_refused_with_the_reason(model_dir_of, model_type):
    with pytest.raises(ModelLoadError, match=REFUSED[model_type][2]):
        LLM(model_dir_of(model_type), num_blocks=16)


def test_update_weights_gives_the_new_checkpoints_tokens(model_dir_of):
    # GPT-2 ties lm_head.weight to transformer.wte.weight: names other than the native ones.
    llm = LLM(model_dir_of("gpt2"), **ENGINE_OPTIONS)
    new_dir = model_dir_of("gpt2", seed=1)
    expected = [hf_greedy(new_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    assert greedy_tokens(llm, PROMPTS) != expected
    assert llm.update_weights(dict(iterate_checkpoint(new_dir))) == 1
    assert greedy_tokens(llm, PROMPTS) == expected


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_tokens(model_dir_of, level):
    model_dir = model_dir_of("gemma3_text")
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    before = greedy_tokens(llm, PROMPTS)
    llm.sleep(level=level)
    llm.wake_up()
    if level == 2:  # the weights were discarded; the buffers (RoPE) must have survived
        llm.update_weights(dict(iterate_checkpoint(model_dir)))
    assert greedy_tokens(llm, PROMPTS) == before



@pytest.mark.parametrize("level", [1, 2])
def test_a_moe_model_sleeps_and_takes_a_trainers_named_parameters(model_dir_of, level):
    """Qwen3-MoE: its checkpoint holds one tensor per expert, the module fused ones (what
    transformers converts on load); a trainer sends the module's names."""
    llm = LLM(model_dir_of("qwen3_moe"), **ENGINE_OPTIONS)
    new_dir = model_dir_of("qwen3_moe", seed=1)
    expected = [hf_greedy(new_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    before = greedy_tokens(llm, PROMPTS)
    assert before != expected
    llm.sleep(level=level)
    if level == 1:
        llm.wake_up()
        assert greedy_tokens(llm, PROMPTS) == before
    else:
        llm.wake_up(["weights"])  # discarded: the update fills them
    trainer_model = load_hf_model(new_dir)
    assert any("experts.gate_up_proj" in name for name, _ in trainer_model.named_parameters())
    assert llm.update_weights(trainer_model.named_parameters()) == 1
    llm.wake_up()
    assert greedy_tokens(llm, PROMPTS) == expected
