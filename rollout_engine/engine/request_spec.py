"""A prompt's request, checked and complete: what the scheduler's requests are built from."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_engine.core.request import Request
from rollout_engine.engine.detokenizer import CompletionText
from rollout_engine.engine.output_processor import RequestGroup
from rollout_engine.protocol import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from rollout_engine.core.structured_output import RequestGrammar


@dataclass(frozen=True)
class RequestSpec:
    """What the input processor made of one prompt and its parameters: every check done, every
    field of its `n` requests known (see `new_group`)."""

    request_id: str
    prompt: str | None
    """The prompt's text (None: it came as token ids)."""
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    output_kind: RequestOutputKind
    """What the prompt's outputs carry (see RequestOutputKind)."""
    compiled_grammar: concurrent.futures.Future | None
    """Structured outputs: the constraint's matcher, compiling off the engine thread."""
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    """`SamplingParams.bad_words` as token id sequences."""
    text_tokenizer: object | None
    """Decodes each completion's text and finds its stop strings (None: nothing decoded)."""
    prompt_logprobs_start: int
    """With `prompt_logprobs`: the first prompt position asked for (0: none asked)."""
    lora_id: int = 0
    """The LoRA adapter its requests run under (the engine's id; 0: the base model)."""

    def new_group(self) -> RequestGroup:
        """The prompt's `n` requests, as the scheduler takes them, and their completions' text.
        Sample 0 computes the prompt logprobs; its siblings reuse its KV."""
        children, texts = [], []
        for j in range(self.sampling_params.n):
            text = self._completion_text()
            children.append(Request(
                f"{self.request_id}/{j}",
                self.prompt_token_ids,
                self.sampling_params,
                group_id=self.request_id,
                sample_index=j,
                grammar=self._grammar(),
                stop_checker=None if text is None else text.stop_checker,
                bad_words_token_ids=self.bad_words_token_ids,
                prompt_logprobs_start=self.prompt_logprobs_start if j == 0 else 0,
                lora_id=self.lora_id,
            ))
            texts.append(text)
        return RequestGroup(self.request_id, self.prompt, list(self.prompt_token_ids),
                            children=children, output_kind=self.output_kind, texts=texts)

    def _completion_text(self) -> CompletionText | None:
        """One completion's text, with its stop-string finder (each sample decodes its own)."""
        if self.text_tokenizer is None:
            return None
        return CompletionText(self.text_tokenizer, self.prompt_token_ids, self.sampling_params)

    def _grammar(self) -> RequestGrammar | None:
        """One request's matcher of the constraint (each sample advances its own)."""
        if self.compiled_grammar is None:
            return None
        from rollout_engine.core.structured_output import RequestGrammar  # llguidance

        return RequestGrammar(self.compiled_grammar)
