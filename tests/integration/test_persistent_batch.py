"""The real model runner's persistent batch: each step copies what is new (tokens, block ids),
and requests leave it when they finish or are aborted, through empty steps too."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=80, seed=2, ignore_eos=True)


@pytest.fixture
def llm(llama_dir):
    return LLM(str(llama_dir), block_size=4)


def test_a_step_copies_the_new_block_ids_only(llm):
    engine = llm.engine
    batch = engine.worker.model_runner.batch
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"p{i}", prompt, PARAMS)
    copied = []
    while engine.has_unfinished_requests():
        before = batch.num_block_ids_written
        engine.step()
        copied.append(batch.num_block_ids_written - before)
    num_samples = len(PROMPTS) * PARAMS.n
    # A decode step allocates at most one 4-token block per sample; the whole tables (up to
    # 22 blocks each by the end) are never copied again.
    assert max(copied[1:]) <= num_samples
    # Each table entry crossed once: KV for all but the last of 5 + 80 and 7 + 80 tokens.
    assert sum(copied) == PARAMS.n * (-(-84 // 4) + -(-86 // 4))


def test_finished_and_aborted_requests_leave_the_batch(llm):
    engine = llm.engine
    batch = engine.worker.model_runner.batch
    llm.generate(PROMPTS, PARAMS)
    first_run = set(batch.requests)  # finished: dropped with the next step's news
    engine.add_request("kept", PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("aborted", PROMPTS[1], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert not first_run & set(batch.requests)
    assert {"kept/0", "aborted/0"} <= set(batch.requests)
    engine.abort_request(["aborted"])
    engine.step()
    assert "aborted/0" not in batch.requests and "kept/0" in batch.requests
    while engine.has_unfinished_requests():
        engine.step()
    assert set(batch.requests) <= {"kept/0"}
