"""Sliding-window attention from a checkpoint's config, against the Hugging Face model.

Qwen2 with every layer windowed (`use_sliding_window`, `max_window_layers=0`) and Qwen3 with
full and sliding layers mixed (`layer_types`), on prompts longer than the window: greedy
tokens equal transformers' through every attention path the CPU has (prefill chunks, decode
rows in the compiled kernel and in the torch path, prefix-cache groups, draft verification).
"""

from __future__ import annotations

import json

import pytest

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import ModelLoadError
from rollout_engine.tiny_model import build_tiny_model
from tests.integration.hf_oracle import hf_greedy_batch
from tests.integration.test_parity import make_prompts

MAX_NEW_TOKENS = 24
# 10 prompts of 23..60 tokens, half sharing a 20-token prefix: all longer than the windows.
PROMPTS = [p for p in make_prompts(16, seed=3) if len(p) > 22][:10]

MODELS = {
    # name: (architecture, config overrides)
    "qwen2-all-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                    "max_window_layers": 0}),
    "qwen3-mixed": ("qwen3", {"use_sliding_window": True, "sliding_window": 13,
                              "layer_types": ["sliding_attention", "full_attention"]}),
}
SETTINGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "block_size": 4},
    "prefix_caching": {"enable_prefix_caching": True, "block_size": 4},
    "spec_decode": {"num_speculative_tokens": 3, "block_size": 4},
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """Each model's directory and transformers' greedy continuations of PROMPTS."""
    root = tmp_path_factory.mktemp("sliding")
    models = {}
    for name, (arch, overrides) in MODELS.items():
        model_dir = str(build_tiny_model(root / name, arch, seed=4, **overrides))
        models[name] = (model_dir, hf_greedy_batch(model_dir, PROMPTS, MAX_NEW_TOKENS))
    return models


def test_the_config_really_windows_the_layers(windowed):
    from transformers import AutoConfig

    qwen2 = AutoConfig.from_pretrained(windowed["qwen2-all-sliding"][0])
    assert qwen2.layer_types == ["sliding_attention"] * 2 and qwen2.sliding_window == 8
    qwen3 = AutoConfig.from_pretrained(windowed["qwen3-mixed"][0])
    assert qwen3.layer_types == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers_past_the_window(windowed, name, setting, kernel,
                                                     monkeypatch):
    if kernel == "torch":
        monkeypatch.setenv("ROLLOUT_ENGINE_CPU_KERNEL", "0")
    model_dir, expected = windowed[name]
    llm = LLM(model_dir, **SETTINGS[setting])
    windows = [layer.self_attn.sliding_window for layer in llm.engine.worker.model_runner.model.model.layers]
    assert windows == ([8, 8] if name.startswith("qwen2") else [13, None])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_layer_type_we_cannot_run_is_refused_at_load(tmp_path):
    model_dir = build_tiny_model(tmp_path / "odd", "qwen3", seed=0)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["layer_types"] = ["full_attention", "chunked_attention"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="layer_types"):
        LLM(str(model_dir))
