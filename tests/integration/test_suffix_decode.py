"""Suffix drafting end to end, on GRPO-shaped work (n samples per prompt, the same prompts again
each epoch): outputs equal those of an engine that does not draft, greedy and seeded sampling
alike, in a batch, under preemption and under the drafting budget; from the second epoch the
drafts come from the first epoch's completions and are accepted."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams
from tests.integration.test_spec_decode import repetitive_prompts

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
# Prompts with no repeats of their own: drafts can only come from earlier completions.
PROMPTS = [[3 + (37 * i + 11 * j) % 480 for j in range(6 + i % 5)] for i in range(6)]


def epochs(llm: LLM, params: SamplingParams, num_epochs: int = 2) -> list[list[list[int]]]:
    """Each epoch's completions, prompt by prompt, sample by sample."""
    return [[[c.token_ids for c in output.outputs] for output in llm.generate(PROMPTS, params)]
            for _ in range(num_epochs)]


@pytest.mark.parametrize("options", [{}, {"num_blocks": 40, "block_size": 4,
                                          "enable_prefix_caching": False}],
                         ids=["batch", "preemption"])
def test_seeded_grpo_epochs_equal_those_without_drafting(llama_dir, options):
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    expected = epochs(LLM(str(llama_dir), **options), params)
    llm = LLM(str(llama_dir), speculative_config=SUFFIX, **options)
    first = llm.generate(PROMPTS, params)
    accepted_in_first = llm.stats()["spec_num_accepted_tokens"]
    second = llm.generate(PROMPTS, params)
    got = [[[c.token_ids for c in o.outputs] for o in outputs] for outputs in (first, second)]
    assert got == expected
    assert expected[0] == expected[1]  # seeded: each epoch samples the same completions
    stats = llm.stats()
    # The second epoch drafted the first epoch's completions: most of its tokens came as
    # accepted drafts.
    num_tokens = sum(len(c) for prompt in expected[1] for c in prompt)
    assert stats["spec_num_accepted_tokens"] - accepted_in_first > num_tokens // 2, stats
    # Each completion counts its own drafts: together, the engine's.
    completions = [c for output in second for c in output.outputs]
    assert sum(c.num_accepted_draft_tokens for c in completions) == (
        stats["spec_num_accepted_tokens"] - accepted_in_first)
    assert all(c.num_draft_tokens >= c.num_accepted_draft_tokens for c in completions)
    assert stats["spec_suffix_prompts"] == len(PROMPTS)
    if options:
        assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_greedy_equals_no_drafting_under_the_budget(llama_dir):
    """Above `disable_by_batch_size` running requests only that many draft, the longest
    expected first; the tokens do not change."""
    prompts = repetitive_prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(llama_dir)).generate(prompts, params)]
    llm = LLM(str(llama_dir), speculative_config={**SUFFIX, "disable_by_batch_size": 3})
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.stats()
    assert stats["spec_num_budgeted_steps"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_num_disabled_steps"] == 0


def test_history_survives_until_reset_and_options_are_checked(llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(llama_dir), speculative_config=SUFFIX)
    llm.generate(PROMPTS, params)
    assert llm.stats()["spec_suffix_cached_tokens"] > 0
    llm.reset_draft_history()
    assert llm.stats()["spec_suffix_cached_tokens"] == 0
    with pytest.raises(TypeError, match="draft_model"):
        LLM(str(llama_dir), speculative_config={"method": "suffix", "draft_model": "x"})
    with pytest.raises(ValueError, match="method"):
        LLM(str(llama_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 2})
