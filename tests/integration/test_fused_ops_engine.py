"""The native decoder with the fused CPU ops (`kernels/csrc/fused_ops_cpu.cpp`) against the
same decoder on torch's ops, through a real engine: the same greedy tokens, logprobs within
bfloat16's rounding; and Hugging Face's model stays the oracle in float32."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.models import layers

PROMPTS = [[5, 9, 13, 2, 7, 7, 30], [11, 4], [3] * 20]
FUSED_OPS = ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "store_kv")
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """Qwen3 (q/k norms) with heads of 64: every op takes its vector path."""
    return str(build_tiny_model(tmp_path_factory.mktemp("fused") / "qwen3", "qwen3", "tiny",
                                hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=64))


def run(model_dir: str, dtype: str):
    llm = LLM(model_dir, dtype=dtype, seed=0, num_blocks=64, block_size=4)
    try:
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


def chosen_logprobs(output) -> torch.Tensor:
    return torch.tensor(output.outputs[0].logprobs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_equals_the_torch_ops(monkeypatch, model_dir, dtype):
    if not cpu_extension.available():
        pytest.skip("no compiled CPU kernels here: the engine runs the torch ops anyway")
    calls = set()

    def counted(name: str):
        op = getattr(cpu_extension, name)
        return lambda *args: calls.add(name) or op(*args)

    for name in FUSED_OPS:
        monkeypatch.setattr(cpu_extension, name, counted(name))
    fused = run(model_dir, dtype)
    assert calls == set(FUSED_OPS), "not every fused op ran"
    monkeypatch.setattr(layers, "runs_fused", lambda _x: False)
    plain = run(model_dir, dtype)
    tolerance = 2e-2 if dtype == "bfloat16" else 1e-5
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(chosen_logprobs(a), chosen_logprobs(b), atol=tolerance,
                                   rtol=0)
