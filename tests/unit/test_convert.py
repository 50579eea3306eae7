"""The server's wire messages for Generate and GenerateBatch (rollout_engine.server.convert),
and what the client rebuilds from them: top logprobs per delta and whole at the end, prompt
logprobs once, stop strings and stop token ids, Score requests checked."""

from __future__ import annotations

import pytest

from protos import rollout_pb2 as pb
from rollout_engine.protocol import (
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
    ScoreOutput,
    TopLogprobs,
)
from rollout_engine.protocol.wire_codec import from_message
from rollout_engine.server.convert import (
    batch_completions,
    generate_response,
    score_request_from_proto,
    score_response,
)
from trainer_bridge.client_messages import apply_generate_response as _apply_generate_response
from trainer_bridge.client_messages import prompt_logprobs_from_proto as _prompt_logprobs

PROMPT = [5, 6, 7]
PROMPT_LOGPROBS = [None, TopLogprobs([6, 2], [-1.5, -0.5], [3, 1]),
                   TopLogprobs([7, 7], [-0.25, -0.25], [1, 1])]


def top(token: int) -> TopLogprobs:
    """The entry of a sampled `token`, then the two most likely (itself among them)."""
    return TopLogprobs([token, 1, token], [-0.5, -0.25, -0.5], [2, 1, 2])


def delta(index: int, token: int, **fields) -> CompletionOutput:
    return CompletionOutput(index, [token], [-0.5], top_logprobs=[top(token)], **fields)


def step_outputs() -> list[RequestOutput]:
    """DELTA_THEN_WHOLE outputs of a prompt with two samples: prompt logprobs once, sample 1
    stops on a string at its second token, sample 0 on a stop token id at its third; each
    finished sample whole."""
    return [
        RequestOutput("g", PROMPT, [delta(0, 10), delta(1, 20)], prompt_logprobs=PROMPT_LOGPROBS),
        RequestOutput("g", PROMPT, [delta(0, 11), whole(1, [20, 21], finish_reason="stop",
                                                        stop_str="</a>", text="hi")]),
        RequestOutput("g", PROMPT, [whole(0, [10, 11, 12], finish_reason="stop",
                                          stop_token_id=12)]),
    ]


def whole(index: int, tokens: list[int], **fields) -> CompletionOutput:
    return CompletionOutput(index, tokens, [-0.5] * len(tokens),
                            top_logprobs=[top(t) for t in tokens], **fields)


def messages_of(outputs: list[RequestOutput]) -> list[pb.GenerateResponse]:
    return [generate_response("g", output, i == 0) for i, output in enumerate(outputs)]


def test_deltas_carry_top_logprobs_and_the_end_carries_the_whole_completion():
    messages = messages_of(step_outputs())
    first = messages[0]
    assert list(first.prompt_token_ids) == PROMPT
    assert _prompt_logprobs(first.prompt_logprobs) == PROMPT_LOGPROBS  # empty first entry: None
    assert not messages[1].prompt_logprobs and not messages[1].prompt_token_ids
    assert [from_message(e, TopLogprobs) for e in first.deltas[1].top_logprobs] == [top(20)]
    (stopped,) = messages[1].outputs
    assert from_message(stopped, CompletionOutput) == whole(
        1, [20, 21], finish_reason="stop", stop_str="</a>", text="hi")
    assert from_message(messages[2].outputs[0], CompletionOutput) == whole(
        0, [10, 11, 12], finish_reason="stop", stop_token_id=12)

    snapshot = RequestOutput("", [], [])
    for message in messages[:1]:
        _apply_generate_response(snapshot, message)
    assert snapshot.prompt_logprobs == PROMPT_LOGPROBS
    assert snapshot.outputs[0].top_logprobs == [top(10)]
    for message in messages[1:]:
        _apply_generate_response(snapshot, message)
    assert snapshot.outputs == [
        whole(0, [10, 11, 12], finish_reason="stop", stop_token_id=12),
        whole(1, [20, 21], finish_reason="stop", stop_str="</a>", text="hi"),
    ]
    assert snapshot.outputs[0].stop_reason == 12 and snapshot.outputs[1].stop_reason == "</a>"


def test_without_logprobs_nothing_extra_travels():
    plain = [RequestOutput("g", PROMPT, [CompletionOutput(0, [10], [-0.5])]),
             RequestOutput("g", PROMPT, [CompletionOutput(0, [10, 11], [-0.5, -0.5],
                                                          finish_reason="length")])]
    messages = messages_of(plain)
    assert not messages[0].prompt_logprobs and not messages[0].deltas[0].top_logprobs
    final = from_message(messages[1].outputs[0], CompletionOutput)
    assert final == CompletionOutput(0, [10, 11], [-0.5, -0.5], finish_reason="length")
    assert final.top_logprobs is None and final.stop_reason is None


def test_final_only_streams_send_the_prompt_logprobs_with_the_completions():
    done = whole(0, [10, 11], finish_reason="length")
    message = generate_response(
        "g", RequestOutput("g", PROMPT, [done], prompt_logprobs=PROMPT_LOGPROBS), is_first=True)
    assert not message.deltas and from_message(message.outputs[0], CompletionOutput) == done
    assert _prompt_logprobs(message.prompt_logprobs) == PROMPT_LOGPROBS


def test_batch_sends_the_prompt_logprobs_with_a_prompts_first_completion_only():
    outputs = [whole(0, [10], finish_reason="length"), whole(1, [20], finish_reason="length")]
    items = batch_completions(0, RequestOutput("b:0", PROMPT, outputs,
                                               prompt_logprobs=PROMPT_LOGPROBS))
    assert [len(item.prompt_logprobs) for item in items] == [len(PROMPT), 0]
    assert _prompt_logprobs(items[0].prompt_logprobs) == PROMPT_LOGPROBS
    assert [from_message(item.output, CompletionOutput) for item in items] == outputs


@pytest.mark.parametrize(
    ("sequences", "prompt_lens", "match"),
    [
        ([], [], "at least one sequence"),
        ([[1, 2, 3]], [1, 1], "one each"),
        ([[1, 2, 3]], [0], "prompt_len must be in"),
        ([[1, 2, 3]], [3], "prompt_len must be in"),
    ],
)
def test_bad_score_requests_are_refused(sequences, prompt_lens, match):
    request = pb.ScoreRequest(sequences=[pb.TokenIds(token_ids=s) for s in sequences],
                              prompt_lens=prompt_lens)
    with pytest.raises(InvalidRequestError, match=match):
        score_request_from_proto(request)


def test_score_request_and_response_round_trip():
    request = pb.ScoreRequest(sequences=[pb.TokenIds(token_ids=[1, 2, 3])], prompt_lens=[2],
                              logprobs=0)
    assert score_request_from_proto(request) == ([[1, 2, 3]], [2], 0)
    request.ClearField("logprobs")
    assert score_request_from_proto(request)[2] is None
    scores = [ScoreOutput([-0.5], [TopLogprobs([3], [-0.5], [4])], 2), ScoreOutput([-1.0, -2.0])]
    reply = score_response(scores)
    assert [from_message(o, ScoreOutput) for o in reply.outputs] == scores
