"""`RequestOutput.num_cached_tokens` (vLLM's): the prompt tokens read from the prefix cache
instead of computed, as the scheduler found them when the prompt was first scheduled; what
the HTTP usage reports as `prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_bytes=4 << 20, block_size=BLOCK,
               enable_prefix_caching=True)


def full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def test_a_repeated_prompt_reads_its_full_blocks_from_the_cache(llm):
    prompt = list(range(20, 31))  # 11 tokens: two full blocks
    (first,) = llm.generate([prompt], GREEDY)
    (second,) = llm.generate([prompt], GREEDY)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == full_blocks(len(prompt)) == 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_next_turn_of_a_conversation_hits_every_block_of_the_last(llm):
    """A turn that extends the previous prompt and completion (token in): everything with
    KV (all but the last sampled token) in full blocks comes from the cache."""
    prompt = list(range(40, 53))
    (turn1,) = llm.generate([prompt], GREEDY)
    history = prompt + turn1.outputs[0].token_ids
    (turn2,) = llm.generate([history + [7, 8, 9]], GREEDY)
    assert turn2.num_cached_tokens == full_blocks(len(history) - 1)


def test_a_group_reports_its_first_sample(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4)
    prompt = list(range(60, 70))
    (cold,) = llm.generate([prompt], params)
    (warm,) = llm.generate([prompt], params)
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 8)
