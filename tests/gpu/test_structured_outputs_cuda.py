"""Structured outputs on a GPU: the grammar bitmask reaches the device sampler, completions
satisfy their constraints, and greedy tokens match the CPU engine's (fp32)."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams
from tests.integration.test_structured_outputs import CONSTRAINTS, PROMPTS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["json", "regex", "choice", "grammar"])
def test_constrained_generation_on_cuda(llama_dir, name):
    constraint, is_valid = CONSTRAINTS[name]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
    sampled = SamplingParams(n=8, temperature=1.0, max_tokens=96, seed=3,
                             structured_outputs=constraint)
    cpu = LLM(str(llama_dir)).generate(PROMPTS, greedy)
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", async_scheduling=True)
    try:
        gpu = llm.generate(PROMPTS, greedy)
        assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
        for output in llm.generate(PROMPTS, sampled):
            for completion in output.outputs:
                if completion.finish_reason == "stop":
                    assert is_valid(completion.text), completion.text
    finally:
        llm.engine.shutdown()
