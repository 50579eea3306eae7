"""Routed experts in streams: DELTA outputs carry the rows read since the previous output (the
prompt's with the first tokens), read from the store a step's new rows at a time, and they add
up to what an unstreamed request returns: with prefix-cache hits, preemption, the last token's
row absent, and DELTA_THEN_WHOLE (gRPC's kind) ending with the whole completion."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_engine import LLM, RequestOutputKind, SamplingParams
from tests.integration.test_routed_experts import PROMPTS, moe_dir, routing_of  # noqa: F401

GREEDY = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(moe_dir):  # noqa: F811
    return LLM(str(moe_dir), enable_return_routed_experts=True).generate(PROMPTS, GREEDY)


def stream(llm: LLM, kind: RequestOutputKind, tag: str) -> tuple[dict[str, list], list[int]]:
    """Every output of each prompt, and the store rows read at each step."""
    engine, store = llm.engine, llm.engine.worker.routed_experts
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", prompt, GREEDY, kind)
    outputs: dict[str, list] = {}
    num_rows_read = []
    while engine.has_unfinished_requests():
        before = store.num_rows_read
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        num_rows_read.append(store.num_rows_read - before)
    return outputs, num_rows_read


def joined(outputs: list) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(prompt rows, the deltas' output rows joined, rows per delta) of one prompt's stream."""
    (prompt,) = [o.prompt_routed_experts for o in outputs if o.prompt_routed_experts is not None]
    assert outputs[0].prompt_routed_experts is prompt  # with the first tokens, once
    rows = [c.routed_experts.to_numpy() for o in outputs for c in o.outputs]
    return prompt.to_numpy(), np.concatenate(rows), [len(r) for r in rows]


@pytest.mark.parametrize("setup", ["prefix_hits", "preemption"])
def test_delta_rows_add_up_to_the_unstreamed_ones(moe_dir, expected, setup):  # noqa: F811
    if setup == "prefix_hits":
        llm = LLM(str(moe_dir), enable_return_routed_experts=True, block_size=4)
        llm.generate(PROMPTS, GREEDY)  # the prompts' blocks are cached now
    else:
        llm = LLM(str(moe_dir), enable_return_routed_experts=True, num_blocks=5, block_size=4,
                  enable_prefix_caching=False)
    outputs, num_rows_read = stream(llm, RequestOutputKind.DELTA, setup)
    for i, want in enumerate(expected):
        got = outputs[f"{setup}-{i}"]
        prompt, rows, num_rows = joined(got)
        num_tokens = [len(c.token_ids) for o in got for c in o.outputs]
        assert [t for o in got for c in o.outputs for t in c.token_ids] == \
            want.outputs[0].token_ids
        assert np.array_equal(prompt, want.prompt_routed_experts.to_numpy())
        # The last token's row is absent, as in the unstreamed output; the others lag by one.
        assert np.array_equal(rows, want.outputs[0].routed_experts.to_numpy())
        assert num_rows == [num_tokens[0] - 1, *num_tokens[1:]]
    if setup == "prefix_hits":
        assert all(outputs[f"{setup}-{i}"][0].num_cached_tokens >= 4 for i in range(2))
    else:
        assert llm.stats()["num_preemptions"] > 0
    # Each row was read once: a step reads only its new rows, not a stream's whole history.
    assert sum(num_rows_read) == sum(len(routing_of(o)) for o in expected)


def test_delta_then_whole_ends_with_the_whole_completion(moe_dir, expected):  # noqa: F811
    llm = LLM(str(moe_dir), enable_return_routed_experts=True)
    outputs, _ = stream(llm, RequestOutputKind.DELTA_THEN_WHOLE, "whole")
    for i, want in enumerate(expected):
        first, *deltas, last = outputs[f"whole-{i}"]
        assert np.array_equal(first.prompt_routed_experts.to_numpy(),
                              want.prompt_routed_experts.to_numpy())
        assert last.prompt_routed_experts is None  # sent once, with the first tokens
        assert np.array_equal(last.outputs[0].routed_experts.to_numpy(),
                              want.outputs[0].routed_experts.to_numpy())
        sent = np.concatenate([c.routed_experts.to_numpy()
                               for o in [first, *deltas] for c in o.outputs])
        assert np.array_equal(sent, want.outputs[0].routed_experts.to_numpy()[: len(sent)])
