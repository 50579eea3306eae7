"""Logprobs in `vllm serve`'s three JSON forms: the completions API's (`tokens`,
`token_logprobs`, `top_logprobs` dicts, `text_offset`), the chat API's (`content` entries with
`top_logprobs` lists) and `prompt_logprobs` (per position, token id -> logprob, rank, text).

The engine's `TopLogprobs` hold the sampled (or prompt) token first, then the top k; vLLM's
dicts are that list with repeats dropped, which is what every form below walks. Logprobs are
clamped to -9999.0 as vLLM does, so JSON never sees an infinity.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout_engine.protocol import TopLogprobs

MIN_LOGPROB = -9999.0


class TokenTexts:
    """The text each token id shows as: `token_id:<id>` (`return_tokens_as_token_ids`, or no
    tokenizer), else the token decoded alone (as vLLM's `decoded_token`); memoised."""

    def __init__(self, tokenizer, as_token_ids: bool) -> None:
        self._tokenizer = None if as_token_ids else tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self._tokenizer is None
                    else self._tokenizer.decode([token_id]))
            self._texts[token_id] = text
        return text


def _entries(top: TopLogprobs) -> list[tuple[int, float, int]]:
    """(token id, logprob, rank), the first token first, each token once (vLLM's dict)."""
    seen: dict[int, tuple[float, int]] = {}
    for token_id, logprob, rank in zip(top.token_ids, top.logprobs, top.ranks):
        seen.setdefault(token_id, (max(logprob, MIN_LOGPROB), rank))
    return [(t, lp, r) for t, (lp, r) in seen.items()]


def completion_logprobs(
    token_ids: Sequence[int], positions: Sequence[TopLogprobs | None], num_top: int,
    texts: TokenTexts, text_offset: int = 0,
) -> dict:
    """The completions API's `logprobs` of these tokens: per position the token's logprob and
    the first `num_top + 1` entries (the token itself, then the top ones)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, top in zip(token_ids, positions):
        offsets.append(text_offset)
        token = texts(token_id)
        tokens.append(token)
        text_offset += len(token)
        if top is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        entries = _entries(top)
        token_logprobs.append(entries[0][1])
        top_logprobs.append({texts(t): lp for t, lp, _ in entries[: num_top + 1]})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[TopLogprobs], num_top: int,
                  texts: TokenTexts) -> dict:
    """The chat API's `logprobs`: per token its logprob and the dict's first `num_top` entries
    (vLLM's `_get_top_logprobs`: the sampled token leads them)."""
    content = []
    for token_id, top in zip(token_ids, positions):
        entries = _entries(top)
        token = texts(token_id)
        content.append({
            "token": token, "logprob": entries[0][1], "bytes": _utf8(token),
            "top_logprobs": [{"token": texts(t), "logprob": lp, "bytes": _utf8(texts(t))}
                             for t, lp, _ in entries[:num_top]],
        })
    return {"content": content}


def prompt_logprobs_json(positions: Sequence[TopLogprobs | None], texts: TokenTexts
                         ) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per position None (the first) or token id (a JSON key) ->
    {"logprob", "rank", "decoded_token"}, the prompt's token first."""
    return [None if top is None else {
        str(t): {"logprob": lp, "rank": r, "decoded_token": texts(t)}
        for t, lp, r in _entries(top)
    } for top in positions]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
