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
