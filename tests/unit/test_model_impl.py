"""Which modeling code runs a config (`model_impl`), and what the transformers backend refuses
from the config alone (no model is built)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

from rollout_engine.config import EngineConfig, ModelConfig
from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.models.registry import resolve_model_backend, resolve_model_impl
from rollout_engine.worker.models.transformers_backend import check_config, num_kv_shared_layers_of

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
        (transformers.Llama4TextConfig(**SMALL), "chunked_attention"),
        (transformers.LlamaConfig(
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        ), "follows the batch's longest sequence"),
    ],
    ids=["encoder-decoder", "not-causal-lm", "hybrid", "chunked", "dynamic-rope"],
)
def test_refused_from_the_config(config, reason):
    with pytest.raises(ModelLoadError, match=reason):
        check_config(config)


def test_an_unused_sliding_window_is_not_checked():
    # Qwen2-MoE writes sliding_window=0 when no layer slides.
    config = transformers.Qwen2MoeConfig(**SMALL)
    check_config(config)


@pytest.mark.parametrize(
    "config",
    [transformers.Gemma2Config(**SMALL), transformers.DeepseekV3Config(**SMALL),
     transformers.GptOssConfig(**SMALL)],
    ids=["softcap", "mla", "sinks"],
)
def test_what_the_kernels_now_compute_is_not_refused_from_the_config(config):
    check_config(config)  # the load probe checks each layer's attention call


def test_the_layers_that_share_kv_come_from_the_config():
    config = transformers.Gemma3nTextConfig(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4,
    )
    assert num_kv_shared_layers_of(config) == 2
    assert num_kv_shared_layers_of(transformers.LlamaConfig(**SMALL)) == 0


def test_the_transformers_backend_runs_eagerly_and_replicated():
    gpt2 = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="runs eagerly"):
        resolve_model_backend(EngineConfig.from_kwargs("dir", cuda_graphs=True), gpt2)
    with pytest.raises(ValueError, match="does not split models yet"):
        resolve_model_backend(EngineConfig.from_kwargs("dir", tensor_parallel_size=2), gpt2)
    assert resolve_model_backend(EngineConfig.from_kwargs("dir"), gpt2).name == "transformers"


# ------------------------------------------------------------- what the native decoder runs
def qwen2(**fields) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **SMALL, **fields)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (transformers.LlamaConfig(architectures=["LlamaForCausalLM"], hidden_act="gelu_new"),
         "hidden_act='gelu_new'"),
        (qwen2(hidden_act="quick_gelu"), "hidden_act='quick_gelu'"),
        (transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], **SMALL, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         "rope_parameters="),
        (transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **SMALL, rope_parameters={
            "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
            "partial_rotary_factor": 0.5}), "rope_parameters="),
        (qwen2(quantization_config={"quant_method": "fp8"}), "quantization_config="),
        (qwen2(layer_types=["full_attention", "chunked_attention"]), "layer_types="),
        (qwen2(use_sliding_window=True, sliding_window=0, max_window_layers=0),
         "sliding_window=0"),
    ],
    ids=["act-llama", "act-qwen2", "dynamic-rope", "partial-rotary", "quantized",
         "chunked-layer", "zero-window"],
)
def test_auto_hands_a_field_native_lacks_to_transformers_and_native_names_it(config, field):
    """Before the fix the native decoder ran these (SiLU for any activation): other tokens."""
    assert resolve_model_impl(config, "auto") == "transformers"
    with pytest.raises(ModelLoadError, match=re.escape(field)):
        resolve_model_impl(config, "native")


@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"])
def test_the_activations_native_runs(act):
    config = transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], **SMALL, hidden_act=act)
    assert resolve_model_impl(config, "auto") == "native"


def test_fields_a_family_ignores_are_ignored_as_transformers_does():
    """Qwen2/Qwen3 build no MLP biases whatever `mlp_bias` says, Llama reads no window."""
    from rollout_engine.worker.models.decoder import DecoderForCausalLM, sliding_windows_of

    config = qwen2(mlp_bias=True)
    assert resolve_model_impl(config, "auto") == "native"
    with torch.device("meta"):
        model = DecoderForCausalLM(config, max_positions=8)
    assert model.model.layers[0].mlp.gate_proj.bias is None
    llama = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **SMALL, sliding_window=4)
    assert resolve_model_impl(llama, "auto") == "native"
    assert sliding_windows_of(llama) == [None, None]


def test_every_field_the_hugging_face_families_read_is_in_the_table():
    """A transformers upgrade that makes Llama/Qwen2/Qwen3 read a new config field fails here
    until the field is implemented (or routed to the transformers backend) in the table."""
    from rollout_engine.worker.models.native_config import (
        NATIVE_CONFIG_FIELDS,
        UNCHECKED_CONFIG_FIELDS,
    )

    known = {f.name for f in NATIVE_CONFIG_FIELDS} | UNCHECKED_CONFIG_FIELDS
    pattern = re.compile(r"""config\.(\w+)|getattr\(\s*(?:self\.)?config,\s*["'](\w+)["']""")
    for family in ("llama", "qwen2", "qwen3"):
        path = Path(transformers.__file__).parent / "models" / family / f"modeling_{family}.py"
        read = {a or b for a, b in pattern.findall(path.read_text())}
        assert read - known == set(), f"{family} reads config fields the table lacks"
