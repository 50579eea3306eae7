"""A completion's text is the same whichever way it is asked for (FINAL_ONLY, CUMULATIVE,
DELTA streams, with or without stop strings) and is vLLM's: its tokens decoded after the
prompt's last tokens, without the text of a stop token (EOS, `stop_token_ids`) unless
`include_stop_str_in_output`. The tokenizer is SentencePiece-style (Metaspace, byte
fallback): decoded alone, its first output token would lose its leading space."""

from __future__ import annotations

import dataclasses

import pytest

from rollout_engine import LLM, RequestOutputKind, SamplingParams

PROMPT = "Some of"
KINDS = (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def llm(metaspace_model_dir) -> LLM:
    return LLM(str(metaspace_model_dir))


@pytest.fixture(scope="module")
def ids(llm) -> dict[str, int]:
    vocab = llm.tokenizer.get_vocab()
    return {"the": vocab["\u2581the"], "of": vocab["\u2581of"], "eos": llm.tokenizer.eos_token_id}


def texts(llm: LLM, prompt, params: SamplingParams) -> dict[str, list[str]]:
    """Per output kind, with and without a stop string that never matches: each sample's
    text (DELTA's pieces joined)."""
    engine, found = llm.engine, {}
    for kind in KINDS:
        for stop in ([], ["never in this text"]):
            request_id = f"{kind.name}-{len(stop)}-{id(params)}"
            engine.add_request(request_id, prompt, dataclasses.replace(params, stop=stop), kind)
            pieces: dict[int, list[str]] = {}
            while engine.has_unfinished_requests():
                for output in engine.step():
                    for completion in output.outputs:
                        if kind is RequestOutputKind.DELTA or output.finished:
                            pieces.setdefault(completion.index, []).append(completion.text)
            samples = ["".join(pieces[j]) if kind is RequestOutputKind.DELTA else pieces[j][-1]
                       for j in sorted(pieces)]
            found[f"{kind.name}{' stop' if stop else ''}"] = samples
    return found


def assert_all_equal(found: dict[str, list[str]], expected: list[str] | None = None) -> None:
    expected = expected if expected is not None else found["FINAL_ONLY"]
    assert {path: text for path, text in found.items() if text != expected} == {}, expected


def test_the_first_token_keeps_its_leading_space_on_every_path(llm, ids):
    params = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=[ids["the"]])
    assert_all_equal(texts(llm, PROMPT, params), [" the the the the"])
    (offline,) = llm.generate([PROMPT], params)
    assert offline.outputs[0].text == " the the the the"


def test_sampled_texts_are_the_same_on_every_path(llm):
    # Random tokens of a random model: byte tokens that do not make characters included.
    for prompt in (PROMPT, "héllo wörld 日本", [5, 17, 99, 3, 42]):
        params = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
        assert_all_equal(texts(llm, prompt, params))


@pytest.mark.parametrize("stop_token", ["of", "eos"])
def test_a_stop_tokens_text_is_left_out_unless_asked_for(llm, ids, stop_token):
    token = ids[stop_token]
    # min_tokens masks the stop token for two tokens; then its bias makes it the next.
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2,
                            allowed_token_ids=[ids["the"], token], logit_bias={token: 50.0},
                            skip_special_tokens=False,
                            stop_token_ids=[token] if stop_token == "of" else [])
    stop_text = {"of": " of", "eos": "<|endoftext|>"}[stop_token]
    for include in (False, True):
        found = texts(llm, PROMPT, dataclasses.replace(params, include_stop_str_in_output=include))
        assert_all_equal(found, [" the the" + (stop_text if include else "")])
    (offline,) = llm.generate([PROMPT], params)
    assert offline.outputs[0].token_ids == [ids["the"], ids["the"], token]
    assert offline.outputs[0].finish_reason == "stop"
