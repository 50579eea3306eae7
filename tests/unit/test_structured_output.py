"""Grammar bookkeeping: constraints validated on the caller's thread, compiled once per
distinct constraint, and the step bitmask over drafts with rollback."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_engine.core.structured_output import GrammarCompiler, RequestGrammar
from rollout_engine.protocol import InvalidRequestError, StructuredOutputsParams
from rollout_engine.tiny_model import build_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def compiler():
    tokenizer = build_tokenizer(VOCAB)
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    compiler.hf_tokenizer = tokenizer
    yield compiler
    compiler.shutdown()


def allowed(mask_row: np.ndarray) -> set[int]:
    bits = (mask_row[:, None].astype(np.int64) >> np.arange(32)) & 1
    return set(np.flatnonzero(bits.reshape(-1)[:VOCAB]).tolist())


def test_params_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="non-empty"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'


def test_a_constraint_compiles_once_and_each_request_has_its_own_matcher(compiler):
    params = StructuredOutputsParams(regex="(ab)+")
    first = RequestGrammar(compiler.compile(params))
    second = RequestGrammar(compiler.compile(params))
    first.wait(10)
    second.wait(10)
    assert first._compiled is second._compiled, "compiled once, cached by constraint"
    a = compiler.hf_tokenizer.convert_tokens_to_ids("a")
    assert first.accept(a)
    assert second.matcher.validate_tokens([a]) == 1, "the second matcher did not move"


def test_the_bitmask_over_drafts_stops_at_a_forbidden_draft_and_rolls_back(compiler):
    a, b = (compiler.hf_tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(regex="(ab)+")))
    grammar.wait(10)
    before = compiler.bitmask([(grammar, [])])
    mask = compiler.bitmask([(None, [7]), (grammar, [a, a, b])])
    assert mask.shape == (2 + 4, (VOCAB + 31) // 32)
    assert (mask[:2] == -1).all(), "an unconstrained request's positions allow everything"
    assert a in allowed(mask[2]) and b not in allowed(mask[2])
    assert b in allowed(mask[3]) and a not in allowed(mask[3]), "after draft 'a', only 'b'"
    # The second 'a' is forbidden by the row before it; the rows after it go unmasked.
    assert (mask[4:] == -1).all()
    assert np.array_equal(compiler.bitmask([(grammar, [])]), before), "rolled back"
    assert not grammar.matcher.is_error()


def test_a_bad_constraint_is_refused_with_the_library_message(compiler):
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        compiler.compile(StructuredOutputsParams(regex="(a"))


def test_a_complete_grammar_allows_only_eos_which_ends_the_constraint(compiler):
    """vLLM's rule: once the grammar is complete its mask allows only EOS; the EOS, sampled,
    ends the constraint, and what follows it (only with ignore_eos) is free. Before the fix
    the request ended at completion, without an EOS."""
    a, b = (compiler.hf_tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    eos = compiler.hf_tokenizer.eos_token_id
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(regex="ab")))
    grammar.wait(10)
    assert grammar.accept(a) and grammar.accept(b)
    mask = compiler.bitmask([(grammar, [eos, a])])
    assert [allowed(row) for row in mask] == [{eos}, set(range(VOCAB)), set(range(VOCAB))]
    assert not grammar.is_terminated
    assert grammar.accept(eos) and grammar.is_terminated
    assert grammar.accept(a), "past its EOS (ignore_eos) a request is unconstrained"
    assert (compiler.bitmask([(grammar, [])]) == -1).all()


def test_drafts_past_an_eos_the_grammar_accepts_are_free(compiler):
    a, b = (compiler.hf_tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    eos = compiler.hf_tokenizer.eos_token_id
    grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(regex="a(b)?")))
    grammar.wait(10)
    mask = compiler.bitmask([(grammar, [a, eos, a])])
    assert [allowed(row) for row in mask] == [{a}, {b, eos}, set(range(VOCAB)),
                                              set(range(VOCAB))]
    assert allowed(compiler.bitmask([(grammar, [])])[0]) == {a}, "rolled back"


ADDED_TOKEN = "<tool_call>"


def test_an_added_token_in_the_constraint_text_is_consumed_as_its_text():
    """A Qwen-style added (not special) token: llguidance's tokenizer took it for a special
    token, so the mask let it through (the tokenizer encodes "<tool_call>" to it) and then
    the matcher refused it: the request ended with finish reason "abort" after one token."""
    tokenizer = build_tokenizer(VOCAB - 1)
    tokenizer.add_tokens([ADDED_TOKEN])
    tool_call = tokenizer.convert_tokens_to_ids(ADDED_TOKEN)
    assert tool_call == VOCAB - 1 and not tokenizer.added_tokens_decoder[tool_call].special
    compiler = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    try:
        grammar = RequestGrammar(compiler.compile(StructuredOutputsParams(regex=r"<tool_call>\d")))
        grammar.wait(10)
        assert tool_call in allowed(compiler.bitmask([(grammar, [])])[0])
        assert grammar.accept(tool_call), grammar.matcher.get_error()
        seven = tokenizer.convert_tokens_to_ids("7")
        assert allowed(compiler.bitmask([(grammar, [])])[0]) >= {seven}
        assert grammar.accept(seven)
        assert allowed(compiler.bitmask([(grammar, [])])[0]) == {tokenizer.eos_token_id}
        assert compiler.tokenizer.is_special_token(tokenizer.eos_token_id), "still special"
        assert not compiler.tokenizer.is_special_token(tool_call)
    finally:
        compiler.shutdown()
