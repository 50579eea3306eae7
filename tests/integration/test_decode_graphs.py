"""The CUDA-graph decode path (static buffers, padding to a bucket, a scratch block) gives
the plain path's tokens. Off the GPU it runs eagerly, so the CPU checks everything but the
capture itself; `tests/gpu/test_engine_cuda.py` checks the capture."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams
from rollout_engine.worker.cuda_graphs import buckets_up_to
from tests.integration.test_spec_decode import repetitive_prompts

SETTINGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_blocks": 40, "block_size": 4, "enable_prefix_caching": False},
    "spec_decode": {"num_speculative_tokens": 3},
}


def run(model_dir, prompts, params, **options):
    llm = LLM(str(model_dir), dtype="float32", **options)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return llm, outputs


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("num_prompts", [3, 7])  # padded to buckets 4 and 8
def test_graph_path_matches_plain_path(llama_dir, setting: str, num_prompts: int) -> None:
    prompts = repetitive_prompts(num_prompts, seed=num_prompts)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
    ]
    params = [params[i % 2] for i in range(num_prompts)]
    _, plain = run(llama_dir, prompts, params, **SETTINGS[setting])
    llm, graphed = run(llama_dir, prompts, params, cuda_graphs=True, **SETTINGS[setting])
    graphs = llm.engine.worker.model_runner.decode_graphs
    assert graphs is not None and graphs.num_steps > 0, "no step took the graph path"
    assert not graphs.capture  # on the CPU: the same path, run eagerly
    for a, b in zip(plain, graphed):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_graph_path_survives_sleep_wake_and_weight_reload(llama_dir) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = repetitive_prompts(5, seed=3)
    llm, before = run(llama_dir, prompts, params, cuda_graphs=True, max_num_seqs=6)
    llm.sleep(level=1)
    llm.wake_up()
    after = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    runner = llm.engine.worker.model_runner
    assert runner.decode_graphs.buckets == (1, 2, 4, 6)
    assert runner.decode_graphs.addresses_unchanged()


def test_buckets_end_at_the_largest_batch() -> None:
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(6) == (1, 2, 4, 6)
    assert buckets_up_to(256)[-3:] == (192, 224, 256)
