"""Which modeling code runs a config (`model_impl`), and what the transformers backend refuses
from the config alone (no model is built)."""

from __future__ import annotations

import pytest
import transformers

from rollout_engine.config import EngineConfig, ModelConfig
from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.models.loader import resolve_model_impl
from rollout_engine.worker.models.transformers_backend import check_config, kv_geometry
from rollout_engine.worker.worker import check_model_impl

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def test_model_impl_is_validated():
    with pytest.raises(ValueError, match="model_impl must be one of"):
        ModelConfig(model="dir", model_impl="vllm")


@pytest.mark.parametrize(
    ("architecture", "model_impl", "expected"),
    [
        ("LlamaForCausalLM", "auto", "native"),
        ("LlamaForCausalLM", "transformers", "transformers"),
        ("Qwen3ForCausalLM", "native", "native"),
        ("MistralForCausalLM", "auto", "transformers"),
    ],
)
def test_resolve_model_impl(architecture, model_impl, expected):
    config = transformers.LlamaConfig(architectures=[architecture])
    assert resolve_model_impl(config, model_impl) == expected


def test_native_refuses_an_architecture_it_does_not_have():
    config = transformers.MistralConfig(architectures=["MistralForCausalLM"])
    with pytest.raises(ModelLoadError, match="no native implementation"):
        resolve_model_impl(config, "native")


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (transformers.BartConfig(), "not a decoder-only causal LM"),
        (transformers.LlamaConfig(architectures=["LlamaForSequenceClassification"]),
         "unsupported architecture"),
        (transformers.Qwen3NextConfig(**SMALL), "recurrent or hybrid"),
        (transformers.Gemma2Config(**SMALL), "attention logit softcapping"),
        (transformers.DeepseekV3Config(**SMALL), "multi-head latent attention"),
        (transformers.GptOssConfig(**SMALL), "attention sinks"),
        (transformers.LlamaConfig(
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        ), "follows the batch's longest sequence"),
    ],
    ids=["encoder-decoder", "not-causal-lm", "hybrid", "softcap", "mla", "sinks", "dynamic-rope"],
)
def test_refused_from_the_config(config, reason):
    with pytest.raises(ModelLoadError, match=reason):
        check_config(config)


def test_an_unused_sliding_window_is_not_checked():
    # Qwen2-MoE writes sliding_window=0 when no layer slides.
    config = transformers.Qwen2MoeConfig(**SMALL)
    check_config(config)


def test_kv_geometry_reads_gpt2_names():
    config = transformers.GPT2Config(n_embd=64, n_head=4)
    assert kv_geometry(config) == (4, 16)


def test_the_transformers_backend_runs_eagerly_and_replicated():
    gpt2 = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="runs eagerly"):
        check_model_impl(EngineConfig.from_kwargs("dir", cuda_graphs=True), gpt2)
    with pytest.raises(ValueError, match="does not split models yet"):
        check_model_impl(EngineConfig.from_kwargs("dir", tensor_parallel_size=2), gpt2)
    assert check_model_impl(EngineConfig.from_kwargs("dir"), gpt2) == "transformers"
