"""Text a tokenizer is asked to encode: refused before any tokenizer work when it holds a lone
surrogate (which no tokenizer takes) or is too long to fit the model in any tokenization.

The length bound is sound: one token stands for at most `max_chars_per_token(tokenizer)`
characters of text, so a text longer than `max_model_len` times that has more than
`max_model_len` tokens. It holds only where the tokenizer's pipeline never drops or merges
characters; for any other tokenizer there is no bound and the text is tokenized as it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollout_engine.protocol import InvalidRequestError

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Unicode composition (NFC, NFKC) merges a character's canonical decomposition, at most 4 code
# points (U+1F82 is alpha and three marks), into one.
_MAX_COMPOSED_CHARS = 4
_EXPANDING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
# Pre-tokenizers that split without removing anything.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


def check_text(text: str, what: str) -> None:
    """InvalidRequestError if `text` holds a lone surrogate (`"\\ud800"` in JSON): it has no
    UTF-8 form, so no tokenizer can encode it."""
    found = _LONE_SURROGATE.search(text)
    if found is not None:
        raise InvalidRequestError(
            f"{what} holds a lone surrogate ({found.group()!a} at character "
            f"{found.start()}), which is not valid Unicode text; send UTF-8 text")


def max_prompt_chars(tokenizer: Any, max_model_len: int | None) -> int | None:
    """The longest text that could still fit in `max_model_len` tokens; None where no sound
    bound is known."""
    if tokenizer is None or max_model_len is None:
        return None
    chars_per_token = max_chars_per_token(tokenizer)
    return None if chars_per_token is None else max_model_len * chars_per_token


def check_prompt_length(text: str, max_chars: int | None, max_model_len: int | None,
                        what: str = "the prompt") -> None:
    """InvalidRequestError for a text longer than `max_chars` (see `max_prompt_chars`)."""
    if max_chars is not None and len(text) > max_chars:
        raise InvalidRequestError(
            f"{what} has {len(text)} characters: more than {max_model_len} tokens in any "
            f"tokenization (one token is at most {max_chars // max_model_len} characters), "
            f"and this model's maximum context length is {max_model_len} tokens; shorten it")


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for: the longest token string of the
    vocabulary (a byte-level symbol stands for one byte, at most one character), times what
    normalization may merge. None for a tokenizer that may drop characters (stripping,
    removing pre-tokenizers, models without a token for every character) or that is not a
    `tokenizers` one: nothing bounds it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pipeline = json.loads(backend.to_str())
    factor = _normalizer_factor(pipeline.get("normalizer"))
    if factor is None or not _pre_tokenizer_keeps(pipeline.get("pre_tokenizer")):
        return None
    if not _model_keeps(pipeline.get("model") or {}, pipeline.get("pre_tokenizer")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in pipeline.get("added_tokens") or []):
        return None  # such a token also takes the whitespace around it, however long
    longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    return factor * max(longest, 1)


def _normalizer_factor(normalizer: dict | None) -> int | None:
    """How many characters of input one character after normalization may stand for."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for step in normalizer.get("normalizers", []):
            step_factor = _normalizer_factor(step)
            if step_factor is None:
                return None
            factor *= step_factor
        return factor
    if kind in _EXPANDING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _MAX_COMPOSED_CHARS
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if "String" not in pattern or not content:
            return None  # a regex, or a deletion: no bound
        return max(1, -(-len(pattern["String"]) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, ...: may drop characters


def _pre_tokenizer_keeps(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _model_keeps(model: dict, pre_tokenizer: dict | None) -> bool:
    """Every character becomes at least one token: byte-level input (every byte is a symbol),
    byte fallback, or an unknown token per unknown character."""
    if model.get("type") not in ("BPE", "Unigram"):
        return False
    if model.get("byte_fallback") or _is_byte_level(pre_tokenizer):
        return True
    return model.get("type") == "BPE" and model.get("unk_token") is not None and not model.get(
        "fuse_unk")


def _is_byte_level(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))
    return pre_tokenizer.get("type") == "ByteLevel"
