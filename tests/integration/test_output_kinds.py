"""Output kinds (vLLM's CUMULATIVE, DELTA, FINAL_ONLY): the same tokens whichever kind, and a
step's output work that is proportional to what the step produced, not to everything
generated so far (RL generates thousands of tokens per sample: cumulative copies are
quadratic in that)."""

from __future__ import annotations

import pytest

from rollout_engine import LLM, RequestOutputKind, SamplingParams

PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=60, seed=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


def run(llm: LLM, kind: RequestOutputKind):
    """Step the engine to the end: (every output of each prompt, token ids copied into
    outputs at each step)."""
    engine = llm.engine
    outputs: dict[str, list] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{kind.name}-{i}", prompt, PARAMS, kind)
    copied = []
    while engine.has_unfinished_requests():
        before = engine.output_processor.num_token_ids_copied
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        copied.append(engine.output_processor.num_token_ids_copied - before)
    return outputs, copied


def assembled(outputs_of_prompt, field: str = "token_ids") -> list:
    """DELTA outputs joined back into whole completions (their tokens, or their text)."""
    joined: dict[int, list] = {}
    for output in outputs_of_prompt:
        for completion in output.outputs:
            joined.setdefault(completion.index, []).append(getattr(completion, field))
    if field == "token_ids":
        return [[t for piece in joined[j] for t in piece] for j in sorted(joined)]
    return ["".join(joined[j]) for j in sorted(joined)]


def test_every_kind_gives_the_same_completions(llm):
    cumulative, _ = run(llm, RequestOutputKind.CUMULATIVE)
    delta, _ = run(llm, RequestOutputKind.DELTA)
    final, _ = run(llm, RequestOutputKind.FINAL_ONLY)
    for i in range(len(PROMPTS)):
        expected = [c.token_ids for c in cumulative[f"CUMULATIVE-{i}"][-1].outputs]
        assert all(len(t) == 60 for t in expected)
        assert assembled(delta[f"DELTA-{i}"]) == expected
        (only,) = final[f"FINAL_ONLY-{i}"]  # one output, when every sample has finished
        assert only.finished and [c.token_ids for c in only.outputs] == expected
        last = delta[f"DELTA-{i}"][-1]
        assert last.finished and all(c.finish_reason == "length" for c in last.outputs)
        # The same text too: DELTA's pieces add up to the others' whole text.
        texts = [c.text for c in cumulative[f"CUMULATIVE-{i}"][-1].outputs]
        assert assembled(delta[f"DELTA-{i}"], "text") == texts == [c.text for c in only.outputs]


def test_a_steps_output_work_does_not_grow_with_the_tokens_generated(llm):
    num_samples = len(PROMPTS) * PARAMS.n
    _, cumulative = run(llm, RequestOutputKind.CUMULATIVE)
    _, delta = run(llm, RequestOutputKind.DELTA)
    _, final = run(llm, RequestOutputKind.FINAL_ONLY)
    # The counter measures what it should: cumulative outputs copy everything so far.
    assert max(cumulative) >= num_samples * 50
    # DELTA: one new token per sample per decode step, however long the completions are.
    assert max(delta) <= num_samples and sum(delta) == num_samples * 60
    # FINAL_ONLY: nothing until a prompt finishes, then its tokens once.
    assert sum(final) == num_samples * 60
    assert sum(c > 0 for c in final) <= len(PROMPTS)


def test_sleep_waiting_for_delta_prompts_returns_every_delta(llm):
    # The drain's steps run inside sleep(mode="wait"): a DELTA consumer must still get the
    # tokens of those steps, not only the last delta.
    engine = llm.engine
    expected, _ = run(llm, RequestOutputKind.CUMULATIVE)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"drained-{i}", prompt, PARAMS, RequestOutputKind.DELTA)
    first = {o.request_id: [o] for o in engine.step()}  # one step before the sleep
    outputs = llm.sleep(level=1, mode="wait")
    llm.wake_up()
    for i in range(len(PROMPTS)):
        mine = first.get(f"drained-{i}", []) + [o for o in outputs
                                                 if o.request_id == f"drained-{i}"]
        assert mine[-1].finished
        assert assembled(mine) == [c.token_ids for c in expected[f"CUMULATIVE-{i}"][-1].outputs]


def test_streams_carry_news_only_and_delta_then_whole_ends_each_sample_whole(llm):
    """Samples stop at different steps here (stop token ids): a stream's output has only the
    samples with news and reports each finish once; DELTA_THEN_WHOLE's finishing output has
    its sample whole (gRPC Generate's last message), FINAL_ONLY's completion to the letter."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=5, logprobs=2,
                            stop_token_ids=list(range(0, 512, 8)))
    engine, outputs = llm.engine, {}
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA,
                 RequestOutputKind.DELTA_THEN_WHOLE):
        engine.add_request(kind.name, PROMPTS[0], params, kind)
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs.setdefault(output.request_id, []).append(output)
    (final,) = outputs["FINAL_ONLY"]
    assert len({len(c.token_ids) for c in final.outputs}) > 1  # they did stop apart
    for kind in ("DELTA", "DELTA_THEN_WHOLE"):
        stream = outputs[kind]
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        assert all(c.token_ids or c.finished for o in stream for c in o.outputs)
        ends = [c for o in stream for c in o.outputs if c.finished]
        assert sorted(c.index for c in ends) == list(range(params.n))  # each finish once
    assert assembled(outputs["DELTA"]) == [c.token_ids for c in final.outputs]
    ends = {c.index: c for o in outputs["DELTA_THEN_WHOLE"] for c in o.outputs if c.finished}
    assert [ends[j] for j in range(params.n)] == final.outputs
    assert all(c.text == "" for o in outputs["DELTA_THEN_WHOLE"] for c in o.outputs
               if not c.finished)  # deltas carry no text: it comes whole, decoded once
