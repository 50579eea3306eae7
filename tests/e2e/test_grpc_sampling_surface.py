"""vLLM's sampling surface over gRPC: every SamplingParams field gives what the in-process `LLM`
gives, top-k and prompt logprobs (streamed too) and Score are HF's log_softmax, bad values get
INVALID_ARGUMENT while the server keeps serving, and a TRL GRPO step samples with them."""

from __future__ import annotations

import dataclasses
import re

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from tests.e2e.server_process import ENGINE_OPTIONS
from tests.e2e.test_trl_backend import make_trainer
from tests.integration.hf_oracle import load_hf_model
from trainer_bridge import (
    CompletionOutput,
    EngineClient,
    EngineSleepingError,
    InvalidArgumentError,
    SamplingParams,
    TopLogprobs,
)
from trainer_bridge.engine_pool import EnginePool
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl_logps import token_logprobs

ATOL = 1e-5  # fp32 logprobs
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
COMPLETIONS = [[101, 102, 103, 104], [105, 106], [101, 102, 300]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, llama_dir):
    """This module's server (a TRL step pushes weights to it: the shared one stays as it is)."""
    log_path = tmp_path_factory.mktemp("sampling_surface") / "server.log"
    with EngineServer(llama_dir, engine_options=ENGINE_OPTIONS, log_path=log_path) as server:
        yield server


@pytest.fixture(scope="module")
def engine_client(engine):
    with EngineClient(engine.address, timeout=60) as client:
        client.wait_until_ready(30)
        yield client


@pytest.fixture(scope="module")
def expected(llm) -> list[int]:
    """The greedy continuation of PROMPT."""
    return llm.generate([PROMPT], SamplingParams(**greedy()))[0].outputs[0].token_ids


def greedy(**fields) -> dict:
    return {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **fields}


def generate_both(engine_client, llm, prompts, **fields):
    """The served and the in-process outputs of the same request, checked equal."""
    remote = engine_client.generate(prompts, SamplingParams(**fields))
    local = llm.generate(prompts, SamplingParams(**fields))
    assert_same(remote, local)
    return remote


def assert_same(remote, local) -> None:
    assert len(remote) == len(local)
    for r, l in zip(remote, local):
        assert r.prompt_token_ids == l.prompt_token_ids
        assert r.prompt_logprobs == l.prompt_logprobs  # doubles on the wire: exact
        assert len(r.outputs) == len(l.outputs)
        for rc, lc in zip(r.outputs, l.outputs):  # every field, stop_str and top_logprobs too
            assert dataclasses.replace(rc, weight_version=0) == dataclasses.replace(
                lc, weight_version=0)


@torch.inference_mode()
def hf_log_softmax(model_dir, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: HF's log_softmax at every position but the last (fp32)."""
    logits = load_hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


# ------------------------------------------------------------------------- field by field
def parity_cases(llm, expected) -> dict[str, dict]:
    word = llm.tokenizer.decode([expected[0]]).strip()
    return {
        "logit_bias": greedy(logit_bias={expected[0]: -100.0, 42: 3.0}),
        "allowed_token_ids": greedy(allowed_token_ids=[3, 17, 42, 99, 300]),
        "bad_words": greedy(bad_words=[word]),
        "penalties": greedy(presence_penalty=1.5, frequency_penalty=0.7),
        "truncate_prompt_tokens": greedy(truncate_prompt_tokens=5),
        "special_tokens": greedy(skip_special_tokens=False, spaces_between_special_tokens=False),
        "seeded_everything": {"n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 10,
                              "presence_penalty": 0.5, "frequency_penalty": 0.2,
                              "logit_bias": {3: 2.0}, "bad_words": ["x"], "logprobs": 3,
                              "min_tokens": 2, "stop": ["the"], "prompt_logprobs": 2},
    }


def test_every_field_gives_what_the_in_process_engine_gives(engine_client, llm, expected):
    for name, fields in parity_cases(llm, expected).items():
        remote = generate_both(engine_client, llm, [PROMPT, [40, 41, 42]], **fields)
        assert remote[0].outputs[0].finish_reason, name


def test_stop_string_across_tokens_ends_and_names_the_completion(engine_client, llm, expected):
    tokenizer = llm.tokenizer
    piece = tokenizer.decode(expected[3:6])
    stop = piece[1:-1] if len(piece) > 3 else piece
    # The completion ends with the token whose text completes the string's first occurrence.
    num_tokens = next(k for k in range(1, 17) if stop in tokenizer.decode(expected[:k]))
    text = tokenizer.decode(expected[:num_tokens])
    cut = text.index(stop)
    assert cut < len(tokenizer.decode(expected[:num_tokens - 1])), "must cross a token boundary"
    for include in (False, True):
        fields = greedy(stop=["never in this text", stop], include_stop_str_in_output=include)
        (remote,) = generate_both(engine_client, llm, [PROMPT], **fields)
        out = remote.outputs[0]
        assert out.token_ids == expected[:num_tokens] and len(out.logprobs) == num_tokens
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.stop_str == stop
        assert out.text == text[: cut + (len(stop) if include else 0)]
        streamed = list(engine_client.generate_stream(PROMPT, SamplingParams(**fields)))[-1]
        assert streamed.outputs[0] == out
    stopper = expected[2]
    (remote,) = generate_both(engine_client, llm, [PROMPT], **greedy(stop_token_ids=[stopper]))
    out = remote.outputs[0]
    assert out.token_ids == expected[: expected.index(stopper) + 1]
    assert out.stop_reason == stopper and out.stop_str is None
    (remote,) = generate_both(engine_client, llm, [PROMPT],
                              **greedy(stop_token_ids=[stopper], min_tokens=4))
    assert stopper not in remote.outputs[0].token_ids[:4]


def test_min_tokens_holds_back_eos(engine_client, llm):
    eos = engine_client.info().eos_token_ids[0]
    eager = {"temperature": 0.0, "max_tokens": 12, "logit_bias": {eos: 100.0}}
    (remote,) = generate_both(engine_client, llm, [PROMPT], **eager)
    assert remote.outputs[0].token_ids == [eos] and remote.outputs[0].stop_reason is None
    (remote,) = generate_both(engine_client, llm, [PROMPT], **eager, min_tokens=5)
    out = remote.outputs[0]
    assert eos not in out.token_ids[:5]
    assert out.token_ids[5:] == [eos] and out.finish_reason == "stop"


def test_logit_bias_allowed_tokens_and_bad_words_change_greedy(engine_client, llm, expected):
    cases = parity_cases(llm, expected)
    first = engine_client.generate([PROMPT], SamplingParams(**cases["logit_bias"]))
    assert first[0].outputs[0].token_ids[0] != expected[0]
    allowed = engine_client.generate([PROMPT], SamplingParams(**cases["allowed_token_ids"]))
    assert set(allowed[0].outputs[0].token_ids) <= {3, 17, 42, 99, 300}
    banned = llm.engine.processor.bad_words_token_ids(SamplingParams(**cases["bad_words"]))
    single = {seq[0] for seq in banned if len(seq) == 1}
    out = engine_client.generate([PROMPT], SamplingParams(**cases["bad_words"]))[0].outputs[0]
    assert single and not single & set(out.token_ids)


# ------------------------------------------------------------------------------ logprobs
def test_top_and_prompt_logprobs_equal_hf_log_softmax(engine_client, llm, llama_dir):
    fields = greedy(max_tokens=8, logprobs=5, prompt_logprobs=3)
    (remote,) = generate_both(engine_client, llm, [PROMPT], **fields)
    out = remote.outputs[0]
    reference = hf_log_softmax(llama_dir, PROMPT + out.token_ids)
    assert out.top_logprobs is not None and len(out.top_logprobs) == len(out.token_ids)
    for t, (token, entry) in enumerate(zip(out.token_ids, out.top_logprobs)):
        row = reference[len(PROMPT) - 1 + t]  # greedy: processed is the raw distribution
        assert entry.token_ids[0] == token and entry.ranks[0] == int((row > row[token]).sum()) + 1
        assert entry.logprobs[0] == pytest.approx(row[token].item(), abs=ATOL)
        top = row.topk(5)
        assert entry.token_ids[1:] == top.indices.tolist() and entry.ranks[1:] == [1, 2, 3, 4, 5]
        torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top.values, rtol=0, atol=ATOL)
    assert remote.prompt_logprobs[0] is None and len(remote.prompt_logprobs) == len(PROMPT)
    for position in range(1, len(PROMPT)):
        entry, row = remote.prompt_logprobs[position], reference[position - 1]
        assert entry.token_ids[0] == PROMPT[position]
        assert entry.logprobs[0] == pytest.approx(row[PROMPT[position]].item(), abs=ATOL)
        assert entry.token_ids[1:] == row.topk(3).indices.tolist()
    streamed = list(engine_client.generate_stream(PROMPT, SamplingParams(**fields)))
    assert streamed[0].prompt_logprobs == remote.prompt_logprobs  # in the first message
    assert streamed[-1].outputs == remote.outputs


def test_stream_deltas_carry_top_logprobs(engine_client, llm):
    fields = {"n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 12, "ignore_eos": True,
              "logprobs": 2}
    snapshots = list(engine_client.generate_stream(PROMPT, SamplingParams(**fields)))
    assert len(snapshots) > 2, "tokens should arrive in several messages"
    for snapshot in snapshots:
        for output in snapshot.outputs:
            assert output.top_logprobs is not None
            assert [e.token_ids[0] for e in output.top_logprobs] == output.token_ids
    (local,) = llm.generate([PROMPT], SamplingParams(**fields))
    assert_same([snapshots[-1]], [local])


# ------------------------------------------------------------------------------- scoring
def test_score_equals_hfs_recompute_and_the_in_process_score(engine_client, llm, llama_dir):
    sequences = [PROMPT + c for c in COMPLETIONS]
    prompt_lens = [len(PROMPT)] * len(sequences)
    scores = engine_client.score(sequences, prompt_lens, logprobs=2)
    assert scores == [dataclasses.replace(s, weight_version=scores[0].weight_version)
                      for s in llm.score(sequences, prompt_lens, logprobs=2)]
    for sequence, completion, score in zip(sequences, COMPLETIONS, scores):
        reference = hf_log_softmax(llama_dir, sequence)[len(PROMPT) - 1:]
        expected = reference.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(score.logprobs), expected, rtol=0, atol=ATOL)
        assert [e.token_ids[0] for e in score.top_logprobs] == completion
        assert [e.token_ids[1:] for e in score.top_logprobs] == reference.topk(2).indices.tolist()
    (plain,) = engine_client.score(sequences[:1], prompt_lens[:1])
    assert plain.top_logprobs is None and plain.logprobs == scores[0].logprobs
    # The logprobs a greedy rollout reported are what scoring its tokens gives.
    generated = engine_client.generate([PROMPT], SamplingParams(**greedy(max_tokens=6)))
    completion = generated[0].outputs[0]
    (rescored,) = engine_client.score([PROMPT + completion.token_ids], [len(PROMPT)])
    torch.testing.assert_close(torch.tensor(rescored.logprobs), torch.tensor(completion.logprobs),
                               rtol=0, atol=ATOL)


def test_pool_score_equals_the_clients(engine, engine_client):
    sequences = [PROMPT + c for c in COMPLETIONS] + [[40, 41, 42] + c for c in COMPLETIONS]
    prompt_lens = [len(PROMPT)] * 3 + [3] * 3
    with EnginePool([engine.address, engine.address]) as pool:  # two members, one server
        assert pool.score(sequences, prompt_lens, logprobs=1) == engine_client.score(
            sequences, prompt_lens, logprobs=1)


def test_score_while_asleep_fails_precondition_and_works_after_wake_up(engine_client):
    sequences, prompt_lens = [PROMPT + COMPLETIONS[0]], [len(PROMPT)]
    before = engine_client.score(sequences, prompt_lens)
    engine_client.sleep(level=1)
    try:
        with pytest.raises(EngineSleepingError):
            engine_client.score(sequences, prompt_lens)
    finally:
        engine_client.wake_up()
    assert engine_client.score(sequences, prompt_lens) == before


# ----------------------------------------------------------------------------- bad values
@pytest.fixture(scope="module")
def raw_stub(engine):
    channel = grpc.insecure_channel(engine.address)
    yield pb_grpc.RolloutEngineStub(channel)
    channel.close()


@pytest.fixture
def still_serving(engine_client, expected):
    """After the test: the same greedy output, nothing left running."""
    yield
    out = engine_client.generate([PROMPT], SamplingParams(**greedy()))[0].outputs[0]
    assert out.token_ids == expected
    assert engine_client.info().num_inflight_requests == 0


BAD_FIELDS = {
    "negative_min_tokens": ({"min_tokens": -1}, "min_tokens must be >= 0"),
    "logprobs_above_20": ({"logprobs": 21}, r"logprobs must be None or in \[0, 20\]"),
    "prompt_logprobs_above_20": ({"prompt_logprobs": 21}, "prompt_logprobs must be"),
    "empty_stop_string": ({"stop": ["ok", ""]}, "non-empty strings"),
    "logit_bias_past_vocab": ({"logit_bias": {512: 1.0}}, "logit_bias"),
    "allowed_ids_past_vocab": ({"allowed_token_ids": [3, 4096]}, "allowed_token_ids"),
    "presence_penalty": ({"presence_penalty": 2.5}, "presence_penalty"),
    "logprobs_mode": ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
}


def refusal(streaming_call, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(streaming_call(request, timeout=30))
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_bad_sampling_values_are_invalid_argument(raw_stub, still_serving, case):
    fields, words = BAD_FIELDS[case]
    params = pb.SamplingParams(max_tokens=4, **fields)
    prompt = pb.Prompt(token_ids=pb.TokenIds(token_ids=PROMPT))
    for call, request in [
        (raw_stub.Generate, pb.GenerateRequest(prompt=prompt, sampling_params=params)),
        (raw_stub.GenerateBatch, pb.GenerateBatchRequest(prompts=[prompt], sampling_params=params)),
    ]:
        code, details = refusal(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and re.search(words, details), details


BAD_SCORES = {
    "prompt_len_zero": ([PROMPT + [7]], [0], None, "prompt_len must be in"),
    "no_completion": ([PROMPT], [len(PROMPT)], None, "prompt_len must be in"),
    "past_the_end": ([PROMPT + [7]], [len(PROMPT) + 5], None, "prompt_len must be in"),
    "one_each": ([PROMPT + [7], PROMPT + [8]], [len(PROMPT)], None, "one each"),
    "no_sequences": ([], [], None, "at least one sequence"),
    "logprobs_above_20": ([PROMPT + [7]], [len(PROMPT)], 21, "prompt_logprobs must be"),
    "token_past_vocab": ([PROMPT + [512]], [len(PROMPT)], None, "outside the vocabulary"),
    "too_long": ([list(range(3, 303))], [4], None, "max_model_len"),
}


@pytest.mark.parametrize("case", list(BAD_SCORES))
def test_bad_score_requests_are_invalid_argument(engine_client, still_serving, case):
    sequences, prompt_lens, logprobs, words = BAD_SCORES[case]
    with pytest.raises(InvalidArgumentError, match=words):
        engine_client.score(sequences, prompt_lens, logprobs=logprobs)


def test_values_the_wire_cannot_carry_are_refused_by_the_client(engine_client):
    with pytest.raises(InvalidArgumentError, match="prompt_lens"):
        engine_client.score([PROMPT + [7]], [-1])
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        engine_client.score([PROMPT + [7]], [len(PROMPT)], logprobs=-2)


# ----------------------------------------------------------------------------------- TRL
def test_trl_rows_put_the_sampled_token_first_then_the_others_likeliest_first():
    completion = CompletionOutput(0, [7, 9], [-0.5, -3.0], top_logprobs=[
        TopLogprobs([7, 7, 4], [-0.5, -0.5, -1.5], [1, 1, 2]),  # sampled: the most likely
        TopLogprobs([9, 4, 7], [-3.0, -0.25, -1.0], [5, 1, 2]),  # sampled: not in the top 2
    ])
    assert token_logprobs(completion) == ([[-0.5, -1.5], [-3.0, -0.25, -1.0]],
                                          [[7, 4], [9, 4, 7]])
    plain = CompletionOutput(0, [7, 9], [-0.5, -3.0])
    assert token_logprobs(plain) == ([[-0.5], [-3.0]], [[7], [9]])


def test_grpo_step_with_stop_strings_and_top_logprobs(engine, engine_client, llama_dir, tmp_path):
    """Runs last: it trains the served weights; the checkpoint's are pushed back after."""
    stop = "e"  # frequent in the tiny tokenizer's words: most completions end at it
    outputs, rollouts = [], []  # what the client returned; what the backend gave TRL
    engine_client.generate = recording(engine_client.generate, outputs.extend)
    try:
        trainer = make_trainer(llama_dir, tmp_path, engine_client, max_steps=1,
                               generation_kwargs={"stop": [stop], "logprobs": 2})
        backend = trainer.engine_generation
        backend.generate = recording(backend.generate, rollouts.append)
        trainer.train()
    finally:
        del engine_client.generate
        engine_client.wake_up()
        engine_client.update_weights(AutoModelForCausalLM.from_pretrained(llama_dir))
    first = next(h for h in trainer.state.log_history if "reward" in h)
    assert first["sampling/sampling_logp_difference/max"] < 1e-3, first
    completions = [c for o in outputs for c in o.outputs]
    assert any(c.stop_reason == stop and stop not in c.text for c in completions)
    (_, completion_ids, logprobs, token_ids), = rollouts
    for completion, ids, rows, id_rows in zip(completions, completion_ids, logprobs, token_ids):
        assert ids == completion.token_ids and len(rows) == len(ids)
        for t, (row, id_row) in enumerate(zip(rows, id_rows)):
            assert id_row[0] == ids[t] and row[0] == completion.logprobs[t]  # sampled first
            assert len(id_row) in (2, 3) and len(set(id_row)) == len(id_row)
            assert row[1:] == sorted(row[1:], reverse=True)  # then the others, likeliest first


def recording(method, record):
    """`method`, handing each result to `record` on its way back."""
    def wrapper(*args, **kwargs):
        result = method(*args, **kwargs)
        record(result)
        return result
    return wrapper
