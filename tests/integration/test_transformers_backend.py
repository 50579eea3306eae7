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
from rollout_engine.worker.models.packed_linear import PackedModuleLinears
from rollout_engine.worker.models.transformers_backend import TransformersForCausalLM
from rollout_engine.worker.weights.loader import iterate_checkpoint
from tests.integration.hf_oracle import hf_greedy, hf_logprobs, load_hf_model

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

MLA = {  # multi-head latent attention: K head dim 16 + 8, V head dim 12
    "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 12, "head_dim": 8,
}
ROUTED_MOE = {  # DeepSeek-style: routed and shared experts, the first layer dense
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # model type -> (config class, its arguments)
    "llama": ("LlamaConfig", LLAMA_LIKE),
    "mistral": ("MistralConfig", {**LLAMA_LIKE, "sliding_window": 8}),
    "ministral": ("MinistralConfig", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 8}),
    "qwen2": ("Qwen2Config", {**LLAMA_LIKE, "use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {**LLAMA_LIKE, "head_dim": 16}),
    "gemma": ("GemmaConfig", {**LLAMA_LIKE, "head_dim": 16}),
    # Logit softcapping in attention and on the logits, sliding and full layers.
    "gemma2": ("Gemma2Config", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 8,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0,
                                "query_pre_attn_scalar": 16}),
    "vaultgemma": ("VaultGemmaConfig", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 8,
                                        "attn_logit_softcapping": 5.0,
                                        "final_logit_softcapping": 10.0}),
    "gemma3_text": ("Gemma3TextConfig", {
        **LLAMA_LIKE, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 5.0,
    }),
    # Layers 2 and 3 read the KV of layers 0 and 1 (the same layer types).
    "gemma3n_text": ("Gemma3nTextConfig", {
        **LLAMA_LIKE, "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": VOCAB_SIZE, "hidden_size_per_layer_input": 8,
        "laurel_rank": 8, "activation_sparsity_pattern": [0.0] * 4, "intermediate_size": [128] * 4,
    }),
    "cohere": ("CohereConfig", {**LLAMA_LIKE, "logit_scale": 0.5}),
    "cohere2": ("Cohere2Config", {**LLAMA_LIKE, "num_hidden_layers": 4, "sliding_window": 8,
                                  "logit_scale": 0.5}),
    "phi": ("PhiConfig", LLAMA_LIKE),
    "phi3": ("Phi3Config", LLAMA_LIKE),
    "olmo": ("OlmoConfig", LLAMA_LIKE),
    "olmo2": ("Olmo2Config", LLAMA_LIKE),
    "olmo3": ("Olmo3Config", {**LLAMA_LIKE, "sliding_window": 8}),
    "granite": ("GraniteConfig", {**LLAMA_LIKE, "logits_scaling": 2.0, "embedding_multiplier": 2.0,
                                  "residual_multiplier": 0.5, "attention_multiplier": 0.2}),
    "glm4": ("Glm4Config", {**LLAMA_LIKE, "head_dim": 16}),
    "starcoder2": ("Starcoder2Config", {**LLAMA_LIKE, "sliding_window": 8}),
    "stablelm": ("StableLmConfig", LLAMA_LIKE),
    "smollm3": ("SmolLM3Config", LLAMA_LIKE),
    "nemotron": ("NemotronConfig", LLAMA_LIKE),
    "helium": ("HeliumConfig", {**LLAMA_LIKE, "head_dim": 16}),
    "exaone4": ("Exaone4Config", {**LLAMA_LIKE, "sliding_window": 8}),
    "arcee": ("ArceeConfig", LLAMA_LIKE),
    "seed_oss": ("SeedOssConfig", {**LLAMA_LIKE, "head_dim": 16}),
    "internlm3": ("InternLM3Config", {**LLAMA_LIKE, "head_dim": 16}),
    "bitnet": ("BitNetConfig", LLAMA_LIKE),
    "persimmon": ("PersimmonConfig", {**LLAMA_LIKE, "num_key_value_heads": 4}),
    "biogpt": ("BioGptConfig", {**LLAMA_LIKE, "num_key_value_heads": 4}),
    # Multi-head latent attention: K and V head dims differ.
    "deepseek_v2": ("DeepseekV2Config", {**LLAMA_LIKE, **MLA, **ROUTED_MOE}),
    "deepseek_v3": ("DeepseekV3Config", {**LLAMA_LIKE, **MLA, **ROUTED_MOE}),
    # MoE: transformers fuses the checkpoint's per-expert tensors on load.
    "mixtral": ("MixtralConfig", {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {**LLAMA_LIKE, **MOE, "shared_expert_intermediate_size": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", {**LLAMA_LIKE, **MOE, "head_dim": 16}),
    "olmoe": ("OlmoeConfig", {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2}),
    "granitemoe": ("GraniteMoeConfig", {**LLAMA_LIKE, "num_local_experts": 4,
                                        "num_experts_per_tok": 2}),
    "phimoe": ("PhimoeConfig", {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("Glm4MoeConfig", {**LLAMA_LIKE, **ROUTED_MOE, "head_dim": 16}),
    "dots1": ("Dots1Config", {**LLAMA_LIKE, **ROUTED_MOE, "head_dim": 16}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {**LLAMA_LIKE, "moe_num_experts": 4, "moe_k": 2,
                                            "moe_intermediate_size": 32,
                                            "moe_num_shared_experts": 1}),
    "minimax_m2": ("MiniMaxM2Config", {**LLAMA_LIKE, "head_dim": 16, "num_local_experts": 4,
                                       "num_experts_per_tok": 2}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", {**LLAMA_LIKE, "head_dim": 16, "num_experts": 4,
                                              "moe_topk": 2}),
    "exaone_moe": ("ExaoneMoeConfig", {**LLAMA_LIKE, "head_dim": 16, "num_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "sliding_window": 8}),
    # Attention sinks (one more softmax logit per head), sliding and full layers, MoE.
    "gpt_oss": ("GptOssConfig", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 8,
                                 "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt2": ("GPT2Config", GPT2_LIKE),
    "gpt_bigcode": ("GPTBigCodeConfig", GPT2_LIKE),
    "gptj": ("GPTJConfig", {**GPT2_LIKE, "rotary_dim": 8}),
    "codegen": ("CodeGenConfig", {**GPT2_LIKE, "rotary_dim": 8, "n_ctx": 256}),
    "ctrl": ("CTRLConfig", {"n_embd": 64, "n_layer": 2, "n_head": 4, "dff": 128,
                            "n_positions": 256, "vocab_size": VOCAB_SIZE,
                            "initializer_range": 0.1, **SPECIAL_IDS}),
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
    "qwen3_next": ("Qwen3NextConfig", {**LLAMA_LIKE, "head_dim": 16, **MOE},
                   "recurrent or hybrid"),
    # Its attention adds a learned, input-dependent bias through the mask.
    "doge": ("DogeConfig", {**LLAMA_LIKE, "head_dim": 16}, r"asks for \['attention_mask'\]"),
    # A window in the config, a full causal mask in the model: which one holds is not knowable.
    "moshi": ("MoshiConfig", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 8},
              "which one its attention mask uses cannot be told"),
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
# The same with too few blocks for every sample at once: the newest are preempted and
# recomputed.
PREEMPTING_OPTIONS = {**ENGINE_OPTIONS, "num_blocks": 16}
LOGPROB_ATOL = 1e-5  # fp32


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


def greedy_samples(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """The first sample's (tokens, logprobs) per prompt; both of each prompt's samples must
    agree."""
    samples = []
    for output in llm.generate(prompts, GREEDY):
        first, second = output.outputs
        assert first.token_ids == second.token_ids, "the n=2 greedy samples of a prompt differ"
        samples.append((first.token_ids, first.logprobs))
    return samples


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [tokens for tokens, _ in greedy_samples(llm, prompts)]


def backend_model(llm: LLM) -> TransformersForCausalLM:
    model = llm.engine.worker.model_runner.model
    assert isinstance(model, TransformersForCausalLM), type(model)
    return model


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_greedy_matches_transformers(model_dir_of, model_type):
    """Tokens and logprobs, through chunked prefill, prefix-cache hits and preemption."""
    model_dir = model_dir_of(model_type)
    prompts = [*PROMPTS, PROMPTS[2]]  # the repeated prompt hits the prefix cache
    expected = [hf_greedy(model_dir, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm = LLM(model_dir, model_impl="transformers", **PREEMPTING_OPTIONS)
    samples = greedy_samples(llm, prompts)
    assert [tokens for tokens, _ in samples] == expected
    for prompt, (tokens, logprobs) in zip(prompts, samples):
        hf = hf_logprobs(model_dir, prompt, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), hf, rtol=0, atol=LOGPROB_ATOL)
    packed = llm.engine.worker.packed_weights  # CPU: HF's nn.Linear modules ran packed
    assert packed.is_packed and (packed.num_bytes > 0) == bool(packed.linears)
    assert llm.engine.scheduler.num_prefix_hit_tokens > 0
    assert llm.engine.scheduler.num_preemptions > 0
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


def test_the_kv_cache_follows_each_layers_attention(model_dir_of):
    """Per-layer KV specs from the load probe: MLA's K and V widths, Gemma 3n's shared layers
    (which hold no KV of their own), sliding and full layers."""
    spec = LLM(model_dir_of("deepseek_v2"), **ENGINE_OPTIONS).engine.worker.kv_spec
    assert {(layer.key_head_dim, layer.value_head_dim) for layer in spec.layers} == {(24, 12)}
    spec = LLM(model_dir_of("gemma3n_text"), **ENGINE_OPTIONS).engine.worker.kv_spec
    assert [layer.kv_source_layer for layer in spec.layers] == [None, None, 0, 1]
    assert [layer.sliding_window for layer in spec.layers] == [8, None, 8, None]
    assert spec.bytes_per_token == 2 * (2 * 2 * 16) * 4  # two layers of K and V, fp32
    spec = LLM(model_dir_of("gpt_oss"), **ENGINE_OPTIONS).engine.worker.kv_spec
    assert [layer.sliding_window for layer in spec.layers] == [8, None]


def test_a_model_that_drops_attention_kwargs_still_gets_its_step(model_dir_of, monkeypatch):
    """A kwarg given to the model's forward (our forward passes `use_cache=False`) reaches
    Llama's attention function but not StableLM's, which drops what its layers do not name:
    per-step metadata could not travel that way. The step reaches it through the context,
    and its tokens are HF's."""
    from rollout_engine.worker.models import transformers_attention

    seen: dict[str, set[str]] = {}
    real = transformers_attention.paged_attention_forward

    def recording(module, *args, **kwargs):
        seen.setdefault(module.config.model_type, set()).update(kwargs)
        return real(module, *args, **kwargs)

    # What loading registers (the registry is global: the original comes back at teardown,
    # registered again by the next model built).
    monkeypatch.setattr(transformers_attention, "paged_attention_forward", recording)
    for model_type in ("llama", "stablelm"):
        model_dir = model_dir_of(model_type)
        llm = LLM(model_dir, model_impl="transformers", **ENGINE_OPTIONS)
        expected = [hf_greedy(model_dir, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
        assert greedy_tokens(llm, PROMPTS) == expected
    assert "use_cache" in seen["llama"] and "use_cache" not in seen["stablelm"]


# ------------------------------------------------------------ the engine's features on the backend
def hf_expected(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(model_dir, prompt, MAX_NEW_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("model_type", ["deepseek_v2", "gemma3n_text"])
def test_kv_transfer_moves_every_layers_kv(model_dir_of, model_type):
    """Prefill–decode disaggregation with per-layer KV: MLA's K and V widths, shared layers.
    A decode engine that received wrong or partial KV would not give HF's tokens."""
    from rollout_engine import KVTransferParams

    model_dir = model_dir_of(model_type)
    prefill_llm = LLM(model_dir, block_size=4, num_blocks=64, kv_role="prefill")
    decode_llm = LLM(model_dir, block_size=4, num_blocks=64, kv_role="decode")
    first = SamplingParams(temperature=0.0, max_tokens=1,
                           kv_transfer_params=KVTransferParams(do_remote_decode=True))
    handles = [o.outputs[0].kv_transfer_params for o in prefill_llm.generate(PROMPTS, first)]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True,
                             kv_transfer_params=handle) for handle in handles]
    outputs = decode_llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_expected(model_dir, PROMPTS)
    transfer = decode_llm.engine.kv_transfer  # every prompt position but the last, loaded
    assert transfer.num_loaded_bytes == sum(len(p) - 1 for p in PROMPTS) * transfer.bytes_per_token


def test_async_scheduling_and_structured_outputs_on_the_backend(model_dir_of):
    from rollout_engine import StructuredOutputsParams

    model_dir = model_dir_of("gemma2")
    llm = LLM(model_dir, async_scheduling=True, **ENGINE_OPTIONS)
    assert greedy_tokens(llm, PROMPTS) == hf_expected(model_dir, PROMPTS)
    choices = ["alpha", "beta gamma"]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = llm.generate(["pick one:"] * 4, params)
    assert all(o.outputs[0].text in choices for o in outputs)


def test_a_failed_step_of_the_backend_leaves_no_trace(model_dir_of):
    """The fault fires in the middle layer of the HF decoder (after the first layers wrote
    their KV for the step): the retry must not read that KV."""
    from rollout_engine import DeviceOutOfMemoryError
    from rollout_engine.worker.fault_injection import FaultInjector

    model_dir = model_dir_of("gpt_oss")
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    injector = FaultInjector(when="chunked_prefill", error="oom")
    llm.engine.worker.model_runner.set_fault_injector(injector)
    with pytest.raises(DeviceOutOfMemoryError):
        llm.generate(PROMPTS, GREEDY)
    assert injector.num_raised == 1
    assert llm.info().num_free_blocks == llm.info().num_blocks
    assert greedy_tokens(llm, PROMPTS) == hf_expected(model_dir, PROMPTS)
