"""Config fields of Llama / Qwen2 / Qwen3 checkpoints that change the model: the native decoder
runs those it implements (`native_config.py`), `model_impl="auto"` hands the others to the
transformers backend, and `model_impl="native"` refuses them naming the field. Either way the
greedy tokens are Hugging Face's."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import ModelLoadError
from rollout_engine.tiny_model import build_tiny_model
from tests.integration.hf_oracle import hf_greedy_batch
from tests.integration.test_parity import make_prompts

MAX_NEW_TOKENS = 12
PROMPTS = make_prompts(4, seed=5)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize(
    ("arch", "hidden_act", "model_impl"),
    [
        ("llama", "gelu", "native"),
        ("qwen2", "gelu", "native"),
        ("qwen3", "gelu", "native"),
        ("llama", "relu", "native"),
        ("qwen2", "gelu_pytorch_tanh", "native"),
        ("qwen3", "gelu_new", "transformers"),  # not implemented natively
    ],
)
def test_the_config_activation_gives_hugging_face_tokens(tmp_path, arch, hidden_act, model_impl):
    """Before the fix the native decoder ran SiLU whatever `hidden_act` said: other tokens."""
    model_dir = build_tiny_model(tmp_path / arch, arch, seed=1, hidden_act=hidden_act)
    expected = hf_greedy_batch(str(model_dir), PROMPTS, MAX_NEW_TOKENS)
    llm = LLM(str(model_dir))  # model_impl="auto"
    try:
        assert llm.engine.worker.model_impl == model_impl
        assert greedy_tokens(llm) == expected
    finally:
        llm.engine.shutdown()


def test_native_refuses_a_field_it_does_not_implement_naming_it(tmp_path):
    model_dir = build_tiny_model(tmp_path / "llama", "llama", seed=1, hidden_act="gelu_new")
    with pytest.raises(ModelLoadError, match="hidden_act='gelu_new'"):
        LLM(str(model_dir), model_impl="native")
