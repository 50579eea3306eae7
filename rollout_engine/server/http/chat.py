"""`POST /v1/chat/completions`: one conversation rendered with the chat template, `n`
completions of it, answered as `vllm serve` answers: the assistant message per choice,
`token_ids` and the response's `prompt_token_ids` with `return_token_ids`, chat-form logprobs
(`logprobs` / `top_logprobs`), `routed_experts` (routing_json.py), and server-sent events with
`stream`.

Tools are rendered into the prompt; with `--tool-call-parser` and `--reasoning-parser` the
answer's calls and reasoning are parsed out of the text (`chat_tools.py`).
`POST /v1/chat/completions/tokens` (prime-rl's) takes the same body and `tokens`, the previous
turn's prompt and completion ids: the prompt extends them instead of tokenizing the
conversation again (`extend_tokens`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.engine.chat_template import RenderedChat, extend_tokens
from rollout_engine.parsing import ChatParser
from rollout_engine.protocol import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from rollout_engine.server.http.api_models import (
    ChatCompletionRequest,
    TokenChatCompletionRequest,
)
from rollout_engine.server.http.chat_tools import ChatTools, finish_reason
from rollout_engine.server.http.completions import usage
from rollout_engine.server.http.context import ServingContext, serving
from rollout_engine.server.http.error_responses import json_response
from rollout_engine.server.http.generation import read_json, until_disconnected
from rollout_engine.server.http.logprobs import TokenTexts, chat_logprobs, prompt_logprobs_json
from rollout_engine.server.http.routing_json import StreamedRouting, choice_routed_experts
from rollout_engine.server.http.sampling import chat_params
from rollout_engine.server.http.sse import EventStreamResponse, event

if TYPE_CHECKING:
    from rollout_engine.server.async_engine import Generation

router = APIRouter()
ROLE = "assistant"


@router.post("/v1/chat/completions")
async def create_chat_completion(raw_request: Request) -> Response:
    return await _chat_completion(raw_request, ChatCompletionRequest)


@router.post("/v1/chat/completions/tokens")
async def create_token_chat_completion(raw_request: Request) -> Response:
    """Token in: the prompt is the request's `tokens` and the tokens of what the conversation
    adds after them (`extend_tokens`); earlier turns are never tokenized again."""
    return await _chat_completion(raw_request, TokenChatCompletionRequest)


async def _chat_completion(raw_request: Request, model: type[ChatCompletionRequest]
                           ) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, model, ctx.config.max_message_bytes)
    lora_request = await ctx.resolve_model(request.model)
    tools = ChatTools.for_request(request, ctx.config)
    prompt_request = tools.prompt_request()
    prompt = await ctx.render_chat(prompt_request,
                                   fit_model=request.truncate_prompt_tokens is None)
    if isinstance(request, TokenChatCompletionRequest):
        prompt = await ctx.off_loop(extend_tokens, ctx.processor, prompt_request, prompt,
                                    request.tokens)
    params = tools.constrain(chat_params(request, len(prompt.token_ids), ctx.max_model_len),
                             prompt.text)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
    generation = ctx.engine.generate([prompt.token_ids], [params], kind, "chatcmpl",
                                     lora_request=lora_request)
    if request.stream:
        events = ChatStream(ctx, tools, response_id, prompt, params).events(generation)
        await generation.start()  # admission and the engine's checks answer with a status
        return EventStreamResponse(events, generation.close)
    (output,) = await until_disconnected(raw_request, generation.final_outputs())
    return json_response(chat_response(ctx, tools, response_id, prompt, output))


def chat_response(ctx: ServingContext, tools: ChatTools, response_id: str,
                  prompt: RenderedChat, output: RequestOutput) -> dict:
    request = tools.request
    texts = TokenTexts(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
    prefix = _echo_prefix(request)
    prompt = as_run(ctx, prompt, output)
    choices = []
    for completion in output.outputs:
        parser = tools.parser(prompt.text)
        message = ({"role": ROLE, "content": prefix + completion.text} if parser is None
                   else tools.message(parser, completion.text, prefix))
        choices.append({
            "index": completion.index,
            "message": message,
            "logprobs": None if not request.logprobs else chat_logprobs(
                completion.token_ids, completion.top_logprobs or [], request.top_logprobs or 0,
                texts),
            "finish_reason": finish_reason(completion.finish_reason,
                                           bool(message.get("tool_calls"))),
            "stop_reason": completion.stop_reason,
            "token_ids": completion.token_ids if request.return_token_ids else None,
            "routed_experts": choice_routed_experts(output, completion.routed_experts,
                                                    request.routed_experts_prompt_start),
        })
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    response = {
        "id": response_id, "object": "chat.completion", "created": int(time.time()),
        "model": ctx.answer_model(request.model), "choices": choices,
        "usage": usage(len(prompt.token_ids), num_generated, output.num_cached_tokens or 0),
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

    def __init__(self, ctx: ServingContext, tools: ChatTools, response_id: str,
                 prompt: RenderedChat, params: SamplingParams) -> None:
        self.ctx, self.tools, self.prompt, self.params = ctx, tools, prompt, params
        self.request = request = tools.request
        self.parsers: dict[int, ChatParser] = {}
        """Each choice's parser, with parsing on; built when the run prompt is known."""
        self.num_tool_calls = [0] * params.n
        self.num_cached_tokens = 0
        self.header = {"id": response_id, "object": "chat.completion.chunk",
                       "created": int(time.time()), "model": ctx.answer_model(request.model)}
        self.texts = TokenTexts(ctx.tokenizer, bool(request.return_tokens_as_token_ids))
        self.num_completion_tokens = 0
        self.routing = StreamedRouting(request.routed_experts_prompt_start)
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)

    async def events(self, generation: Generation) -> AsyncIterator[str]:
        try:
            first = True
            async for _, output in generation:
                self.num_cached_tokens = output.num_cached_tokens or self.num_cached_tokens
                self.routing.see(0, output)
                if first:
                    self.prompt, first = as_run(self.ctx, self.prompt, output), False
                    for j in range(self.params.n):
                        yield event(self._first_chunk(j))
                for completion in output.outputs:
                    chunk = self._chunk(completion)
                    if chunk is not None:
                        yield event(chunk)
            if self.include_usage:
                yield event({**self.header, "choices": [], "usage": self._usage()})
        finally:
            generation.close()

    def _first_chunk(self, j: int) -> dict:
        delta = {"role": ROLE, "content": _echo_prefix(self.request)}
        choice = {"index": j, "delta": delta, "logprobs": None, "finish_reason": None}
        self.routing.add(choice, 0, j, None)  # the prompt's rows
        chunk = {**self.header, "choices": [choice]}
        if j == 0 and self.request.return_token_ids:
            chunk["prompt_token_ids"] = self.prompt.token_ids
        if j == 0 and self.request.return_prompt_text:
            chunk["prompt_text"] = self.prompt.text
        return chunk

    def _chunk(self, completion: CompletionOutput) -> dict | None:
        """The chunk of one sample's news; None when parsing held all of its text back and it
        carries nothing else (routed experts included)."""
        self.num_completion_tokens += len(completion.token_ids)
        delta = self._delta(completion)
        reason = finish_reason(completion.finish_reason,
                               self.num_tool_calls[completion.index] > 0)
        rows = completion.routed_experts
        if not (delta or reason or self.request.logprobs or self.request.return_token_ids
                or self.continuous_usage or (rows is not None and rows.shape[0])):
            return None
        choice = {"index": completion.index, "delta": delta,
                  "logprobs": None if not self.request.logprobs else chat_logprobs(
                      completion.token_ids, completion.top_logprobs or [],
                      self.request.top_logprobs or 0, self.texts),
                  "finish_reason": reason,
                  "stop_reason": completion.stop_reason}
        if self.request.return_token_ids:
            choice["token_ids"] = completion.token_ids
        self.routing.add(choice, 0, completion.index, rows)
        chunk = {**self.header, "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = self._usage()
        return chunk

    def _delta(self, completion: CompletionOutput) -> dict:
        if not self.tools.is_parsing:
            return {"content": completion.text}
        parser = self.parsers.get(completion.index)
        if parser is None:
            parser = self.parsers[completion.index] = self.tools.parser(self.prompt.text)
        delta = parser.feed(completion.text)
        if completion.finish_reason is not None:
            delta = delta.merge(parser.finish())
        self.num_tool_calls[completion.index] += len(delta.tool_calls)
        return self.tools.delta(delta)

    def _usage(self) -> dict:
        return usage(len(self.prompt.token_ids), self.num_completion_tokens,
                     self.num_cached_tokens)
