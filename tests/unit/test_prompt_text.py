"""Text refused before tokenizing: lone surrogates, and prompts too long for the model in any
tokenization, with a bound that holds for every text the tokenizer can be given."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rollout_engine.engine.prompt_text import (
    check_prompt_length,
    check_text,
    max_chars_per_token,
    max_prompt_chars,
)
from rollout_engine.protocol import InvalidRequestError
from rollout_engine.tiny_model import SPECIAL_TOKENS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def test_a_lone_surrogate_is_refused_and_named():
    check_text("caf\u00e9 \U0001f600 \u4e2d", "the prompt")  # real characters pass
    with pytest.raises(InvalidRequestError, match=r"bad_words\[2\] holds a lone surrogate "
                                                  r"\('\\ud800' at character 1\)"):
        check_text("a\ud800b", "bad_words[2]")


def test_the_tiny_tokenizer_bound_is_its_longest_token_times_composition(tokenizer):
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert longest == max(map(len, SPECIAL_TOKENS))
    assert max_chars_per_token(tokenizer) == 4 * longest  # its normalizer is NFC
    assert max_prompt_chars(tokenizer, 32) == 32 * 4 * longest
    assert max_prompt_chars(tokenizer, None) is None and max_prompt_chars(None, 32) is None
    with pytest.raises(InvalidRequestError, match="maximum context length is 32 tokens"):
        check_prompt_length("x" * (32 * 4 * longest + 1), 32 * 4 * longest, 32)


def test_no_text_has_fewer_tokens_than_the_bound_says(tokenizer):
    """The bound's promise, on the texts most likely to break it: special tokens, combining
    marks that NFC composes, long runs of whitespace, digits and symbols, multi-byte text."""
    bound = max_chars_per_token(tokenizer)
    rng = random.Random(0)
    pieces = [*SPECIAL_TOKENS, "e\u0301", "\u03b1\u0313\u0300\u0345", "\u1100\u1161\u11a8",
              " " * 50, "\n" * 20, "the ", "1234567", "\U0001f600", "\u4e2d\u6587", "==="]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert num_tokens * bound >= len(text), (text, num_tokens)


def _tokenizer_with(normalizer=None, pre_tokenizer=None, model=None, **special):
    backend = Tokenizer(model or models.BPE(unk_token="[UNK]"))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


@pytest.mark.parametrize("make, sound", [
    (lambda: _tokenizer_with(), True),
    (lambda: _tokenizer_with(normalizers.Sequence([normalizers.Prepend("_"),
                                                   normalizers.Replace(" ", "_")])), True),
    (lambda: _tokenizer_with(normalizers.Strip()), False),  # drops whitespace
    (lambda: _tokenizer_with(normalizers.StripAccents()), False),  # drops marks
    (lambda: _tokenizer_with(normalizers.Replace(" ", "")), False),  # deletes
    (lambda: _tokenizer_with(pre_tokenizer=pre_tokenizers.Whitespace()), False),
    (lambda: _tokenizer_with(model=models.BPE(unk_token="[UNK]", fuse_unk=True)), False),
    (lambda: _tokenizer_with(model=models.BPE()), False),  # an unknown character vanishes
    (lambda: _tokenizer_with(model=models.WordPiece({"[UNK]": 0}, unk_token="[UNK]")), False),
])
def test_a_tokenizer_that_may_drop_characters_has_no_bound(make, sound):
    assert (max_chars_per_token(make()) is not None) == sound

