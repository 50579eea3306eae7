"""Incremental detokenization and stop strings: the text as tokens arrive equals the whole
decode, and the first stop string is found where vLLM finds it."""

from __future__ import annotations

import pytest

from rollout_engine.detokenizer import IncrementalDetokenizer, StopChecker
from rollout_engine.tiny_model import build_tokenizer

VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB_SIZE)


class SlowTokenizer:
    """The same tokenizer without its streaming backend: the offsets path is taken."""

    def __init__(self, fast) -> None:
        self._fast = fast

    def decode(self, token_ids, skip_special_tokens=False):
        return self._fast.decode(token_ids, skip_special_tokens=skip_special_tokens)


TEXTS = [
    "Question: what is 2 + 2?\n\nAnswer: it is 4, of course.",
    "héllo wörld, naïve café: ✓ done; 日本語のテキスト and back to ascii",
    "def f(x):\n    return x ** 2  # squares\n\nprint(f(3))",
]


@pytest.mark.parametrize("slow", [False, True], ids=["stream", "offsets"])
@pytest.mark.parametrize("text", TEXTS, ids=["qa", "unicode", "code"])
def test_incremental_text_is_the_whole_decode_after_the_prompt(tokenizer, slow, text):
    """Multi-byte characters split across tokens come out whole, once complete."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for split in (1, len(ids) // 3, len(ids) // 2):
        prompt, output = ids[:split], ids[split:]
        detokenizer = IncrementalDetokenizer(
            SlowTokenizer(tokenizer) if slow else tokenizer, prompt, skip_special_tokens=True
        )
        pieces = [detokenizer.step(t) for t in output]
        assert detokenizer.text == "".join(pieces)
        # A character split at the prompt's end comes with the output, which completes it.
        assert tokenizer.decode(prompt).rstrip("\ufffd") + detokenizer.text == text, split


def text_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(checker: StopChecker, token_ids: list[int]) -> tuple[int, str | None]:
    """Tokens accepted until a stop string matched (inclusive), and the match."""
    for i, token in enumerate(token_ids):
        match = checker.accept(token)
        if match:
            return i + 1, match
    return len(token_ids), None


def make_checker(tokenizer, stop, include=False, min_tokens=0, prompt=(3, 4)) -> StopChecker:
    detokenizer = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens=True)
    return StopChecker(detokenizer, stop, include, min_tokens)


def test_the_first_stop_string_in_the_text_ends_it_and_cuts_the_text(tokenizer):
    ids = text_tokens(tokenizer, "the answer is 42</answer> and more text after it")
    checker = make_checker(tokenizer, ["</answer>", "more"])
    num_tokens, match = run(checker, ids)
    assert match == "</answer>"
    assert tokenizer.decode(ids[:num_tokens]).endswith("</answer>") or "</answer>" in (
        tokenizer.decode(ids[:num_tokens]))
    assert "</answer>" not in tokenizer.decode(ids[: num_tokens - 1])  # the first token that did
    assert checker.text == "the answer is 42"
    included = make_checker(tokenizer, ["</answer>"], include=True)
    run(included, ids)
    assert included.text == "the answer is 42</answer>"


def test_stop_strings_are_found_only_once_min_tokens_were_generated(tokenizer):
    ids = text_tokens(tokenizer, "ab STOP cd STOP ef")
    early = make_checker(tokenizer, ["STOP"])
    first, _ = run(early, ids)
    late = make_checker(tokenizer, ["STOP"], min_tokens=first + 1)
    second, match = run(late, ids)
    assert match == "STOP" and second > first
    assert late.text == tokenizer.decode(ids[:second]).rsplit("STOP", 1)[0]


def test_no_match_leaves_the_whole_text(tokenizer):
    ids = text_tokens(tokenizer, "nothing to see here")
    checker = make_checker(tokenizer, ["</s>"])
    assert run(checker, ids) == (len(ids), None)
    assert checker.text == tokenizer.decode(ids) and checker.stop_string is None
