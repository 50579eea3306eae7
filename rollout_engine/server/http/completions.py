"""`POST /v1/completions`: text or token-id prompts, one or a list, answered as `vllm serve`
answers them: choices prompt-major (prompt i's sample j at index i * n + j), `token_ids` and
`prompt_token_ids` with `return_token_ids`, logprobs in the completions form, `prompt_logprobs`,
`echo`, `routed_experts` (routing_json.py), and server-sent events with `stream`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.protocol import (
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
    RequestOutputKind,
    TopLogprobs,
)
from rollout_engine.server.http.api_models import CompletionRequest
from rollout_engine.server.http.context import ServingContext, serving
from rollout_engine.server.http.error_responses import json_response
from rollout_engine.server.http.generation import read_json, until_disconnected
from rollout_engine.server.http.logprobs import (
    TokenTexts,
    completion_logprobs,
    prompt_logprobs_json,
)
from rollout_engine.server.http.routing_json import StreamedRouting, choice_routed_experts
from rollout_engine.server.http.sampling import completion_params
from rollout_engine.server.http.sse import EventStreamResponse, event

if TYPE_CHECKING:
    from rollout_engine.server.async_engine import Generation

router = APIRouter()


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None
    """As sent; None for token ids."""


@router.post("/v1/completions")
async def create_completion(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, CompletionRequest, ctx.config.max_message_bytes)
    lora_request = await ctx.resolve_model(request.model)
    prompts = await prompts_of(ctx, request)
    params = [completion_params(request, len(p.token_ids), ctx.max_model_len) for p in prompts]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    generation = ctx.engine.generate([p.token_ids for p in prompts], params, kind, "cmpl",
                                     lora_request=lora_request)
    if request.stream:
        events = CompletionStream(ctx, request, response_id, prompts).events(generation)
        await generation.start()  # admission and the engine's checks answer with a status
        return EventStreamResponse(events, generation.close)
    outputs = await until_disconnected(raw_request, generation.final_outputs())
    return json_response(completion_response(ctx, request, response_id, prompts, outputs))


async def prompts_of(ctx: ServingContext, request: CompletionRequest) -> list[Prompt]:
    """One prompt, or a list: text is tokenized here (as the engine would), off the event
    loop."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise InvalidRequestError("prompt is empty: send a text, token ids, or a list of them")
    if not any(isinstance(p, str) for p in prompt):
        return [Prompt(list(p), None) for p in prompt]  # type: ignore[arg-type]
    fit_model = request.truncate_prompt_tokens is None  # a prompt to truncate may be long
    return await ctx.off_loop(lambda: [
        Prompt(ctx.encode(p, request.add_special_tokens, fit_model), p) if isinstance(p, str)
        else Prompt(list(p), None) for p in prompt])


# ------------------------------------------------------------------------------ one response


def completion_response(ctx: ServingContext, request: CompletionRequest, response_id: str,
                        prompts: list[Prompt], outputs: list[RequestOutput]) -> dict:
    texts = TokenTexts(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
    choices: list[dict] = []
    prompts = [as_run(p, output) for p, output in zip(prompts, outputs)]
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            choice = _choice(ctx, request, prompt, completion, output.prompt_logprobs, texts)
            choice["index"] = len(choices)
            choice["routed_experts"] = choice_routed_experts(
                output, completion.routed_experts, request.routed_experts_prompt_start)
            choices.append(choice)
    echo_only = request.echo and request.max_tokens == 0  # its one token is dropped
    num_generated = 0 if echo_only else sum(
        len(c.token_ids) for output in outputs for c in output.outputs)
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)  # as the engine ran them
    return {
        "id": response_id, "object": "text_completion", "created": int(time.time()),
        "model": ctx.answer_model(request.model), "choices": choices,
        "usage": usage(num_prompt_tokens, num_generated, num_cached(outputs)),
        "system_fingerprint": None, "kv_transfer_params": None,
    }


def _choice(ctx: ServingContext, request: CompletionRequest, prompt: Prompt,
            completion: CompletionOutput, prompt_logprobs: list[TopLogprobs | None] | None,
            texts: TokenTexts) -> dict:
    token_ids, positions, text = _echoed(ctx, request, prompt, completion, prompt_logprobs)
    logprobs = None
    if request.logprobs is not None:
        logprobs = completion_logprobs(token_ids, positions, request.logprobs, texts)
    return {
        "index": 0, "text": text, "logprobs": logprobs,
        "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
        "token_ids": completion.token_ids if request.return_token_ids else None,
        "prompt_logprobs": None if prompt_logprobs is None else prompt_logprobs_json(
            prompt_logprobs, TokenTexts(ctx.tokenizer, False)),
        "prompt_token_ids": prompt.token_ids if request.return_token_ids else None,
    }


def _echoed(ctx: ServingContext, request: CompletionRequest, prompt: Prompt,
            completion: CompletionOutput, prompt_logprobs: list[TopLogprobs | None] | None):
    """(token ids, logprob positions, text) of a choice: with `echo`, the prompt's first
    (alone with `max_tokens=0`). vLLM leaves the prompt's text out with `return_token_ids`."""
    positions: list = list(completion.top_logprobs or [None] * len(completion.token_ids))
    if not request.echo:
        return completion.token_ids, positions, completion.text
    prompt_text = "" if request.return_token_ids else _prompt_text(ctx, prompt)
    prompt_positions = list(prompt_logprobs or [None] * len(prompt.token_ids))
    if request.max_tokens == 0:
        return prompt.token_ids, prompt_positions, prompt_text
    return (prompt.token_ids + completion.token_ids, prompt_positions + positions,
            prompt_text + completion.text)


def as_run(prompt: Prompt, output: RequestOutput) -> Prompt:
    """The prompt as the engine ran it, from its output: with `truncate_prompt_tokens`, its
    last tokens, whose text is theirs (echo), not the text sent."""
    if output.prompt_token_ids == prompt.token_ids:
        return prompt
    return Prompt(list(output.prompt_token_ids), None)


def _prompt_text(ctx: ServingContext, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return "" if ctx.tokenizer is None else ctx.tokenizer.decode(prompt.token_ids)


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
          ) -> dict:
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens` (the prompt tokens read from
    the prefix cache) on every answer."""
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def num_cached(outputs: list[RequestOutput]) -> int:
    return sum(output.num_cached_tokens or 0 for output in outputs)


# -------------------------------------------------------------------------------- streaming


class CompletionStream:
    """The events of one streamed completion request: a chunk per sample of each output (the
    engine's DELTA outputs carry only the samples with news); a usage chunk last if asked
    for. Prompts are described as the engine ran them (`as_run`), once their first output
    came; usage counts those prompts."""

    def __init__(self, ctx: ServingContext, request: CompletionRequest, response_id: str,
                 prompts: list[Prompt]) -> None:
        self.ctx, self.request, self.prompts = ctx, request, prompts
        self.header = {"id": response_id, "object": "text_completion",
                       "created": int(time.time()), "model": ctx.answer_model(request.model)}
        self.texts = TokenTexts(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
        self.ran: dict[int, Prompt] = {}
        self.num_cached: dict[int, int] = {}
        """Each prompt's tokens read from the prefix cache, once its outputs tell."""
        self.num_tokens: dict[tuple[int, int], int] = {}
        """Per (prompt, sample) that has streamed: its tokens so far, for usage."""
        self.text_offsets: dict[tuple[int, int], int] = {}
        self.prompt_logprobs: dict[int, list[TopLogprobs | None]] = {}
        self.routing = StreamedRouting(request.routed_experts_prompt_start)
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        try:
            async for i, output in generation:
                if i not in self.ran:
                    self.ran[i] = as_run(self.prompts[i], output)
                if output.num_cached_tokens is not None:
                    self.num_cached[i] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    self.prompt_logprobs[i] = output.prompt_logprobs
                self.routing.see(i, output)
                for completion in output.outputs:
                    yield event(self._chunk(i, completion))
            if self.include_usage:
                yield event({**self.header, "choices": [], "usage": self._usage()})
        finally:
            generation.close()

    def _chunk(self, i: int, completion: CompletionOutput) -> dict:
        key = (i, completion.index)
        first = key not in self.num_tokens
        request, prompt = self.request, self.ran[i]
        echo_only = request.echo and request.max_tokens == 0  # its one token is dropped
        self.num_tokens[key] = self.num_tokens.get(key, 0) + (
            0 if echo_only else len(completion.token_ids))
        text, token_ids = completion.text, completion.token_ids
        positions = list(completion.top_logprobs or [None] * len(token_ids))
        if request.echo and first:
            prompt_text = "" if request.return_token_ids else _prompt_text(self.ctx, prompt)
            prompt_positions = list(self.prompt_logprobs.get(i)
                                    or [None] * len(prompt.token_ids))
            if echo_only:
                text, token_ids, positions = prompt_text, prompt.token_ids, prompt_positions
            else:
                text, token_ids = prompt_text + text, prompt.token_ids + token_ids
                positions = prompt_positions + positions
        choice = {"index": i * request.n + completion.index, "text": text,
                  "logprobs": self._logprobs(key, token_ids, positions),
                  "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if request.return_token_ids:
            choice["token_ids"] = completion.token_ids
            if first:
                choice["prompt_token_ids"] = prompt.token_ids
        self.routing.add(choice, i, key, completion.routed_experts)
        chunk = {**self.header, "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = self._usage()
        return chunk

    def _logprobs(self, key: tuple[int, int], token_ids: list[int], positions: list
                  ) -> dict | None:
        """The chunk's logprobs; text offsets go on from the tokens reported so far (not the
        text sent: text a stop string could cut is sent late), as in the unstreamed answer."""
        if self.request.logprobs is None:
            return None
        logprobs = completion_logprobs(token_ids, positions, self.request.logprobs, self.texts,
                                       self.text_offsets.get(key, 0))
        if logprobs["tokens"]:
            self.text_offsets[key] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return logprobs

    def _usage(self) -> dict:
        return usage(sum(len(p.token_ids) for p in self.ran.values()),
                     sum(self.num_tokens.values()), sum(self.num_cached.values()))
