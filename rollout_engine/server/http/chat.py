"""`POST /v1/chat/completions`: one conversation rendered with the chat template, `n`
completions of it, answered as `vllm serve` answers: the assistant message per choice,
`token_ids` and the response's `prompt_token_ids` with `return_token_ids`, chat-form logprobs
(`logprobs` / `top_logprobs`), and server-sent events with `stream`.

Tools are rendered into the prompt; the server parses no tool calls (as `vllm serve` without
`--enable-auto-tool-choice`): `tool_choice` must be "none", and the calls are in the text."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.protocol import (
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from rollout_engine.server.http.api_models import ChatCompletionRequest
from rollout_engine.server.http.chat_template import RenderedChat
from rollout_engine.server.http.completions import usage
from rollout_engine.server.http.context import ServingContext, serving
from rollout_engine.server.http.error_responses import json_response
from rollout_engine.server.http.generation import read_json, until_disconnected
from rollout_engine.server.http.logprobs import TokenTexts, chat_logprobs, prompt_logprobs_json
from rollout_engine.server.http.sampling import chat_params
from rollout_engine.server.http.sse import EventStreamResponse, event

if TYPE_CHECKING:
    from rollout_engine.server.async_engine import Generation

router = APIRouter()
ROLE = "assistant"


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, ChatCompletionRequest, ctx.config.max_message_bytes)
    ctx.check_model(request.model)
    check_tool_choice(request)
    prompt = await ctx.render_chat(request, fit_model=request.truncate_prompt_tokens is None)
    params = chat_params(request, len(prompt.token_ids), ctx.max_model_len)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    generation = ctx.engine.generate([prompt.token_ids], [params], kind, "chatcmpl")
    if request.stream:
        events = ChatStream(ctx, request, response_id, prompt, params).events(generation)
        await generation.start()  # admission and the engine's checks answer with a status
        return EventStreamResponse(events, generation.close)
    (output,) = await until_disconnected(raw_request, generation.final_outputs())
    return json_response(chat_response(ctx, request, response_id, prompt, output))


def check_tool_choice(request: ChatCompletionRequest) -> None:
    """vLLM's default is "auto" when tools are given, which needs a tool-call parser; this
    server has none, so only "none" is taken (TRL's VLLMClient sends it). A named tool that is
    not among `tools` gets vLLM's own message."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if isinstance(choice, dict) and not _names_a_given_tool(choice, request.tools or []):
        raise InvalidRequestError("The tool specified in `tool_choice` does not match any of "
                                  "the specified `tools`")
    if choice != "none":
        raise InvalidRequestError(
            f"tool_choice {choice!r} needs a tool-call parser, which this server does not "
            "have: send tool_choice 'none' (the tools are rendered into the prompt and the "
            "model's calls come back in the message text)")


def _names_a_given_tool(choice: dict, tools: list) -> bool:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return any(isinstance(tool, dict) and isinstance(tool.get("function"), dict)
               and tool["function"].get("name") == name for tool in tools)


def chat_response(ctx: ServingContext, request: ChatCompletionRequest, response_id: str,
                  prompt: RenderedChat, output: RequestOutput) -> dict:
    texts = TokenTexts(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
    prefix = _echo_prefix(request)
    prompt = as_run(ctx, prompt, output)
    choices = []
    for completion in output.outputs:
        choices.append({
            "index": completion.index,
            "message": {"role": ROLE, "content": prefix + completion.text},
            "logprobs": None if not request.logprobs else chat_logprobs(
                completion.token_ids, completion.top_logprobs or [], request.top_logprobs or 0,
                texts),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "token_ids": completion.token_ids if request.return_token_ids else None,
        })
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    response = {
        "id": response_id, "object": "chat.completion", "created": int(time.time()),
        "model": ctx.model_name, "choices": choices,
        "usage": usage(len(prompt.token_ids), num_generated),
        "system_fingerprint": None,
        "prompt_logprobs": None if output.prompt_logprobs is None else prompt_logprobs_json(
            output.prompt_logprobs, TokenTexts(ctx.tokenizer, False)),
        "prompt_token_ids": prompt.token_ids if request.return_token_ids else None,
        "kv_transfer_params": None,
    }
    if request.return_prompt_text:
        response["prompt_text"] = prompt.text
    return response


def as_run(ctx: ServingContext, prompt: RenderedChat, output: RequestOutput) -> RenderedChat:
    """The rendered prompt as the engine ran it, from its output: with
    `truncate_prompt_tokens`, its last tokens and their text."""
    if output.prompt_token_ids == prompt.token_ids:
        return prompt
    token_ids = list(output.prompt_token_ids)
    return RenderedChat(ctx.tokenizer.decode(token_ids), token_ids)


def _echo_prefix(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content leads the reply when it is the
    assistant's."""
    last = request.messages[-1]
    if request.echo and last.get("role") == ROLE and isinstance(last.get("content"), str):
        return last["content"]
    return ""


class ChatStream:
    """The events of one streamed chat request: per choice a first chunk with the role (once
    the engine's first output tells the prompt it ran, as vLLM sends it), then a chunk per
    sample of each output (the engine's DELTA outputs carry only the samples with news); a
    usage chunk last if asked for."""

    def __init__(self, ctx: ServingContext, request: ChatCompletionRequest, response_id: str,
                 prompt: RenderedChat, params: SamplingParams) -> None:
        self.ctx, self.request, self.prompt, self.params = ctx, request, prompt, params
        self.header = {"id": response_id, "object": "chat.completion.chunk",
                       "created": int(time.time()), "model": ctx.model_name}
        self.texts = TokenTexts(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
        self.num_completion_tokens = 0
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        try:
            first = True
            async for _, output in generation:
                if first:
                    self.prompt, first = as_run(self.ctx, self.prompt, output), False
                    for j in range(self.params.n):
                        yield event(self._first_chunk(j))
                for completion in output.outputs:
                    yield event(self._chunk(completion))
            if self.include_usage:
                yield event({**self.header, "choices": [], "usage": self._usage()})
        finally:
            generation.close()

    def _first_chunk(self, j: int) -> dict:
        delta = {"role": ROLE, "content": _echo_prefix(self.request)}
        chunk = {**self.header, "choices": [
            {"index": j, "delta": delta, "logprobs": None, "finish_reason": None}]}
        if j == 0 and self.request.return_token_ids:
            chunk["prompt_token_ids"] = self.prompt.token_ids
        if j == 0 and self.request.return_prompt_text:
            chunk["prompt_text"] = self.prompt.text
        return chunk

    def _chunk(self, completion: CompletionOutput) -> dict:
        self.num_completion_tokens += len(completion.token_ids)
        choice = {"index": completion.index, "delta": {"content": completion.text},
                  "logprobs": None if not self.request.logprobs else chat_logprobs(
                      completion.token_ids, completion.top_logprobs or [],
                      self.request.top_logprobs or 0, self.texts),
                  "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if self.request.return_token_ids:
            choice["token_ids"] = completion.token_ids
        chunk = {**self.header, "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = self._usage()
        return chunk

    def _usage(self) -> dict:
        return usage(len(self.prompt.token_ids), self.num_completion_tokens)
