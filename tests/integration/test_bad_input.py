"""Bad input raises a typed error naming the problem; the engine keeps serving others."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from rollout_engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), max_model_len=64)


GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "empty"),
        ([1, 2, 10**6], "outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        (list(range(1, 70)), "max_model_len"),
        ("", "empty"),
        ([1.5, 2], "string or a list of token ids"),
    ],
)
def test_bad_prompt(llm, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], SamplingParams(**GREEDY))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must be"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_engine_keeps_serving_after_bad_input(llm):
    prompt = [5, 6, 7, 8, 9]
    (expected,) = llm.generate([prompt], SamplingParams(**GREEDY))
    engine = llm.engine
    engine.add_request("good", prompt, SamplingParams(**GREEDY))
    engine.step()  # "good" is now in flight
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [1, 10**6], SamplingParams(**GREEDY))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", prompt, SamplingParams(**GREEDY))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["good"]
    assert outputs[0].outputs[0].token_ids == expected.outputs[0].token_ids
    # A batch with one bad prompt fails whole and leaves nothing behind.
    with pytest.raises(InvalidRequestError):
        llm.generate([prompt, []], SamplingParams(**GREEDY))
    assert not engine.has_unfinished_requests()
    assert llm.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0].token_ids == (
        expected.outputs[0].token_ids
    )


def test_text_no_tokenizer_takes_is_refused_before_tokenizing(llm):
    """A lone surrogate (JSON's "\\ud800") in a prompt or a bad word, and a text longer than
    the model can take in any tokenization, are InvalidRequestErrors, not a tokenizer's
    TypeError; the long one is refused without tokenizing it."""
    with pytest.raises(InvalidRequestError, match="the prompt holds a lone surrogate"):
        llm.generate(["hello \ud800"], SamplingParams(**GREEDY))
    with pytest.raises(InvalidRequestError, match=r"bad_words\[1\] holds a lone surrogate"):
        llm.generate([[5, 6]], SamplingParams(bad_words=["fine", "\udfff"], **GREEDY))
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="maximum context length is 64 tokens"):
        llm.generate(["the " * 2_000_000], SamplingParams(**GREEDY))  # 8 MB
    assert time.monotonic() - start < 1.0  # tokenizing it takes seconds
    truncated = SamplingParams(truncate_prompt_tokens=4, **GREEDY)
    (output,) = llm.generate(["the " * 1000], truncated)  # a prompt to truncate may be long
    assert len(output.prompt_token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


def test_abort_ends_request_with_abort(llm):
    engine = llm.engine
    engine.add_request("a", [1, 2, 3], SamplingParams(n=2, **GREEDY))
    engine.step()
    engine.abort_request("a")
    (output,) = engine.step()
    assert output.finished and [o.finish_reason for o in output.outputs] == ["abort", "abort"]
    manager = engine.scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_unknown_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_unknown_architecture(llama_dir, tmp_path):
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(model_dir))


def test_unknown_engine_option(llama_dir):
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(str(llama_dir), max_num_batched_tokenz=4)
