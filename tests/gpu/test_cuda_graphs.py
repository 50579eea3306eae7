"""CUDA graphs on a GPU: captured decode steps give the eager path's tokens, and stay valid
across sleep, wake and weight updates."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.integration.test_spec_decode import repetitive_prompts

pytestmark = pytest.mark.gpu


def greedy(model_dir, dtype: str, prompts, **options):
    # Engines of a test live side by side (freed after it, tests/gpu/conftest.py): a small KV.
    llm = LLM(str(model_dir), device="cuda", dtype=dtype, kv_cache_bytes=64 << 20, **options)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return llm, [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_match_eager(tiny_model_dirs, arch: str, dtype: str) -> None:
    prompts = repetitive_prompts(7, seed=2)  # 7 running requests: padded to bucket 8
    _, eager = greedy(tiny_model_dirs[arch], dtype, prompts)
    llm, graphed = greedy(tiny_model_dirs[arch], dtype, prompts, cuda_graphs=True)
    graphs = llm.engine.worker.model_runner.decode_graphs
    assert graphs.capture and graphs.num_captured > 0 and graphs.num_steps > 0
    tolerance = 1e-3 if dtype == "float32" else 0.05
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= tolerance


def test_graphs_survive_sleep_wake_and_updates(llama_dir) -> None:
    prompts = repetitive_prompts(5, seed=4)
    llm, before = greedy(llama_dir, "float32", prompts, cuda_graphs=True)
    runner = llm.engine.worker.model_runner
    captured = runner.decode_graphs.num_captured
    llm.sleep(level=1)
    llm.wake_up()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    after = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert runner.decode_graphs.addresses_unchanged()
    assert runner.decode_graphs.num_captured == captured  # replayed, not captured again
    # New weights through the update path reach the graphs (they read the same addresses).
    eager, _ = greedy(llama_dir, "float32", prompts)
    scaled = [(name, p.detach().clone() * 0.5) for name, p in runner.model.named_parameters()
              if name.endswith("o_proj.weight")]
    for engine in (llm, eager):
        engine.update_weights(scaled)
    changed = [o.outputs[0] for o in llm.generate(prompts, params)]
    expected = [o.outputs[0] for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in changed] == [o.token_ids for o in expected]
    assert [o.token_ids for o in changed] != [o.token_ids for o in before]
