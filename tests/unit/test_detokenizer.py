"""Completion text and stop strings: the text as tokens arrive equals the whole decode after
the prompt, one decode at the end gives the same text, a stop token's text is left out, and
the first stop string is found where vLLM finds it."""

from __future__ import annotations

import random

import pytest

from rollout_engine.engine.detokenizer import (
    CompletionText,
    IncrementalDetokenizer,
    StopChecker,
    decode_after_prompt,
)
from rollout_engine.protocol import SamplingParams
from rollout_engine.tiny_model import EOS_TOKEN, build_tokenizer, make_corpus
from tests.metaspace_model import build_metaspace_tokenizer

VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(VOCAB_SIZE)


@pytest.fixture(scope="module")
def metaspace():
    return build_metaspace_tokenizer(VOCAB_SIZE)


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


def test_of_two_stop_strings_in_one_piece_the_one_that_ends_first_wins(tokenizer):
    word = max((t for t in tokenizer.get_vocab() if t.startswith("\u0120") and t[1:].isalpha()),
               key=len)[1:]  # a whole word in one token, after a space
    ids = text_tokens(tokenizer, " " + word)
    assert len(ids) == 1 and len(word) >= 5
    checker = make_checker(tokenizer, [word[-2:], word[:3], word[:2]])  # both heads end first
    assert run(checker, ids) == (1, word[:2]) and checker.text == " "


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


# ---------------------------------------------------------------------- completion text
def incremental(tokenizer, prompt, output, skip_special_tokens=True) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    pieces = [detokenizer.step(t) for t in output]
    assert "".join(pieces) == detokenizer.text
    return detokenizer.text


def random_tokens(tokenizer, rng: random.Random, max_segments: int) -> list[int]:
    """Text-like token ids: words, non-ASCII characters, special tokens, and now and then
    tokens drawn at random (byte tokens that make no character among them)."""
    words = make_corpus(50, seed=rng.randrange(1000))
    ids: list[int] = []
    for _ in range(rng.randint(1, max_segments)):
        kind = rng.random()
        if kind < 0.5:
            ids += tokenizer.encode(" " + rng.choice(words), add_special_tokens=False)
        elif kind < 0.7:
            text = "".join(rng.choice("éü日本語✓€") for _ in range(rng.randint(1, 3)))
            ids += tokenizer.encode(text, add_special_tokens=False)
        elif kind < 0.85:
            ids.append(rng.choice(tokenizer.all_special_ids))
        else:
            ids.append(rng.randrange(VOCAB_SIZE))
    return ids


@pytest.mark.parametrize("name", ["byte_level", "metaspace"])
def test_one_decode_after_the_prompt_is_the_incremental_text(tokenizer, metaspace, name):
    """What lets a finished completion be decoded once instead of token by token."""
    tokens = {"byte_level": tokenizer, "metaspace": metaspace}[name]
    rng = random.Random(0)
    num_decoded_once = 0
    for _ in range(300):
        prompt = random_tokens(tokens, rng, 4)
        output = random_tokens(tokens, rng, 8)
        skip = rng.random() < 0.5
        once = decode_after_prompt(tokens, prompt, output, skip)
        text = incremental(tokens, prompt, output, skip)  # never raises, broken bytes or not
        if once is not None:  # None: broken bytes; the text is then decoded incrementally
            assert once == text, (prompt, output, skip)
            num_decoded_once += 1
    assert num_decoded_once > 100


def test_the_first_token_keeps_its_leading_space_after_the_prompt(metaspace):
    prompt = metaspace.encode("Some of", add_special_tokens=False)
    output = metaspace.encode(" the the the the", add_special_tokens=False)
    assert metaspace.decode(output) == "the the the the"  # alone, the space is dropped
    for stop in ([], ["never in this text"]):
        params = SamplingParams(stop=stop)
        final, streamed = (CompletionText(metaspace, prompt, params) for _ in range(2))
        pieces = []
        for i, token in enumerate(output):
            for text in (final, streamed):  # with stop strings the scheduler feeds each token
                assert text.stop_checker is None or not text.stop_checker.accept(token)
            pieces.append(streamed.delta(output[: i + 1], i + 1 == len(output), False))
        assert final.final(output, ended_by_stop_token=False) == " the the the the"
        assert "".join(pieces) == " the the the the"


def test_a_character_cut_by_the_end_of_the_output_gives_no_text(metaspace):
    prompt = text_tokens(metaspace, "Some of")
    output = text_tokens(metaspace, " 日本")
    assert len(output) > 4  # byte fallback: three tokens a character
    for cut in range(len(output) + 1):
        expected = incremental(metaspace, prompt, output[:cut])
        assert "\ufffd" not in expected
        assert decode_after_prompt(metaspace, prompt, output[:cut]) == expected
        assert CompletionText(metaspace, prompt, SamplingParams()).final(output[:cut], False) == (
            expected)
    assert expected == " 日本"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_adds_no_text_unless_asked(tokenizer, include):
    prompt = text_tokens(tokenizer, "Question:")
    output = text_tokens(tokenizer, " four") + [tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    expected = " four" + (EOS_TOKEN if include else "")
    assert CompletionText(tokenizer, prompt, params).final(output, True) == expected
    streamed = CompletionText(tokenizer, prompt, params)
    assert streamed.delta(output[:-1], False, False) + streamed.delta(output, True, True) == (
        expected)
    # Not a stop token (max_tokens ran out on it): its text stays.
    assert CompletionText(tokenizer, prompt, params).final(output, False) == (
        " four" + EOS_TOKEN)


def test_a_stream_holds_back_what_a_stop_string_could_still_cut(tokenizer):
    prompt = text_tokens(tokenizer, "Q:")
    output = text_tokens(tokenizer, " the answer is 42</answer> and more")
    text = CompletionText(tokenizer, prompt, SamplingParams(stop=["</answer>"]))
    sent = ""
    for i, token in enumerate(output):
        if text.stop_checker.accept(token):
            sent += text.delta(output[: i + 1], True, False)
            break
        sent += text.delta(output[: i + 1], False, False)
        assert "<" not in sent  # 8 characters are held back until the stop string is settled
    assert sent == " the answer is 42" == text.final(output[: i + 1], False)


def test_special_tokens_in_a_row_join_without_spaces_when_asked(tokenizer):
    special = [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    text = CompletionText(tokenizer, text_tokens(tokenizer, "Hi"), params)
    assert text.final(special, False) == "".join(tokenizer.convert_ids_to_tokens(special))
