"""`POST /v1/responses` (OpenAI's Responses API, which `vllm serve` answers and openai-agents'
default model class speaks), over the chat pipeline: the input items become chat messages
(instructions first; `function_call` and `function_call_output` items as the assistant's calls
and the tool's answers), function tools become chat tools, and the parsed answer comes back as
`reasoning`, `message` and `function_call` output items. `previous_response_id` continues a
conversation this server answered (the last `MAX_STORED_RESPONSES` are kept in memory).
`stream: true` sends the Responses API's events (`response.created`, `output_item.added`, text,
reasoning and argument deltas, ... `response.completed`), items as the parsers give them.

Refused, saying so: `background`, hosted tools (web search, file search, ...), `conversation`
and stored `prompt` templates."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.parsing import ChatParser, MessageDelta, ParsedMessage
from rollout_engine.protocol import InvalidRequestError, RequestOutput, RequestOutputKind
from rollout_engine.server.http.api_models import ChatCompletionRequest
from rollout_engine.server.http.chat_tools import ChatTools
from rollout_engine.server.http.context import serving
from rollout_engine.server.http.error_responses import json_response
from rollout_engine.server.http.generation import parse_body, read_json_object, until_disconnected
from rollout_engine.server.http.sampling import chat_params
from rollout_engine.server.http.sse import EventStreamResponse, event

router = APIRouter()
MAX_STORED_RESPONSES = 1024
RESPONSES_FIELDS = frozenset({
    "input", "instructions", "tools", "tool_choice", "max_output_tokens", "previous_response_id",
    "store", "reasoning", "text", "stream", "background", "conversation", "prompt", "include",
    "metadata", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
    "max_tool_calls", "top_logprobs", "stream_options", "user"})
"""The Responses API's own fields; the others (model, temperature, top_p, vLLM's sampling
extras such as `seed` or `structured_outputs`) are the chat request's."""
REFUSED = {"background": "background responses are not supported",
           "conversation": "conversation objects are not supported; use previous_response_id",
           "prompt": "stored prompt templates are not supported"}


class ResponseStore:
    """The conversations of recent responses, by id, for `previous_response_id` (bounded:
    the oldest are forgotten first)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        self.max_responses = max_responses
        self._messages: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._messages[response_id] = messages
            while len(self._messages) > self.max_responses:
                self._messages.popitem(last=False)

    def get(self, response_id: str) -> list[dict]:
        with self._lock:
            messages = self._messages.get(response_id)
        if messages is None:
            raise InvalidRequestError(
                f"previous_response_id {response_id!r} is unknown here: this server keeps the "
                f"last {self.max_responses} stored responses in memory")
        return list(messages)


@router.post("/v1/responses")
async def create_response(raw_request: Request) -> Response:
    ctx, store = serving(raw_request), raw_request.app.state.responses
    body = await read_json_object(raw_request, ctx.config.max_message_bytes)
    for name, why in REFUSED.items():
        if body.get(name):
            raise InvalidRequestError(why)
    history = store.get(body["previous_response_id"]) if body.get("previous_response_id") else []
    messages = history + _messages(body)
    request = parse_body(ChatCompletionRequest, _chat_body(body, messages))
    lora_request = await ctx.resolve_model(request.model)
    tools = ChatTools.for_request(request, ctx.config)
    prompt = await ctx.render_chat(tools.prompt_request())
    params = tools.constrain(chat_params(request, len(prompt.token_ids), ctx.max_model_len),
                             prompt.text)
    response_id = f"resp_{uuid.uuid4().hex}"
    stream = ResponseStream(body, response_id, ctx.answer_model(request.model),
                            tools.parser(prompt.text),
                            lambda parsed: store.put(response_id, [
                                *messages, _assistant_message(parsed)]))
    if body.get("stream"):
        generation = ctx.engine.generate([prompt.token_ids], [params], RequestOutputKind.DELTA,
                                         "resp", lora_request=lora_request)
        await generation.start()  # admission and the engine's checks answer with a status
        return EventStreamResponse(stream.events(generation), generation.close)
    generation = ctx.engine.generate([prompt.token_ids], [params], RequestOutputKind.FINAL_ONLY,
                                     "resp", lora_request=lora_request)
    (output,) = await until_disconnected(raw_request, generation.final_outputs())
    for _ in stream.add(output):
        pass
    return json_response(stream.finish())


class ResponseStream:
    """One response's output items as its text arrives (whole, or piece by piece), the events
    of a streamed response on the way, and the response object at the end (stored for
    `previous_response_id` unless `store` is false)."""

    def __init__(self, body: dict, response_id: str, model: str, parser: ChatParser | None,
                 store) -> None:
        self.body, self.response_id, self.model = body, response_id, model
        self.parser, self._store = parser, store
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item text is going into
        self._deltas: list[MessageDelta] = []
        self._num_events = 0
        self.finish_reason: str | None = None
        self.num_prompt_tokens = self.num_output_tokens = self.num_cached_tokens = 0

    async def events(self, generation) -> AsyncIterator[str]:
        try:
            yield self._event("response.created", response=self._response("in_progress"))
            async for _, output in generation:
                for event in self.add(output):
                    yield event
            for event in self._close():
                yield event
            response = self.finish()  # a truncated one ends as OpenAI ends it: "incomplete"
            yield self._event(f"response.{response['status']}", response=response)
        finally:
            generation.close()

    def add(self, output: RequestOutput) -> Iterator[str]:
        """The events of one engine output (the sample's news, or the whole completion)."""
        self.num_prompt_tokens = len(output.prompt_token_ids)
        self.num_cached_tokens = output.num_cached_tokens or self.num_cached_tokens
        for completion in output.outputs:
            self.num_output_tokens += len(completion.token_ids)
            delta = (self.parser.feed(completion.text) if self.parser
                     else MessageDelta(completion.text))
            if completion.finish_reason is not None:
                self.finish_reason = completion.finish_reason
                if self.parser:
                    delta = delta.merge(self.parser.finish())
            self._deltas.append(delta)
            yield from self._delta_events(delta)

    def finish(self) -> dict:
        list(self._close())
        parsed = ParsedMessage.fold(self._deltas)
        if self.body.get("store", True):
            self._store(parsed)
        truncated = self.finish_reason == "length"
        return self._response("incomplete" if truncated else "completed")

    def _delta_events(self, delta: MessageDelta) -> Iterator[str]:
        if delta.reasoning:
            yield from self._text_events("reasoning", delta.reasoning)
        if delta.content:
            yield from self._text_events("message", delta.content)
        for call in delta.tool_calls:
            yield from self._close()
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": call.call.id, "name": call.call.name,
                    "arguments": call.call.arguments, "status": "completed"}
            index = len(self.items)
            self.items.append(item)
            yield self._event("response.output_item.added", output_index=index,
                              item={**item, "arguments": "", "status": "in_progress"})
            yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=item["arguments"])
            yield self._event("response.function_call_arguments.done", item_id=item["id"],
                              output_index=index, arguments=item["arguments"])
            yield self._event("response.output_item.done", output_index=index, item=item)

    def _text_events(self, kind: str, text: str) -> Iterator[str]:
        if self._open is None or self._open["type"] != kind:
            yield from self._close()
            yield from self._open_item(kind)
        item, index = self._open, len(self.items) - 1
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else (
            "response.output_text.delta")
        yield self._event(name, item_id=item["id"], output_index=index, content_index=0,
                          delta=text, **({} if kind == "reasoning" else {"logprobs": []}))

    def _open_item(self, kind: str) -> Iterator[str]:
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [part]}
        else:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                    "status": "completed", "content": [part]}
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        yield self._event("response.output_item.added", output_index=index,
                          item={**item, "content": [], "status": "in_progress"})
        yield self._event("response.content_part.added", item_id=item["id"], output_index=index,
                          content_index=0, part={**part, "text": ""})

    def _close(self) -> Iterator[str]:
        item, self._open = self._open, None
        if item is None:
            return
        index, part = self.items.index(item), item["content"][0]
        done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                else "response.output_text.done")
        yield self._event(done, item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], **({} if item["type"] == "reasoning"
                                                else {"logprobs": []}))
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index,
                          content_index=0, part=part)
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _event(self, kind: str, **fields) -> str:
        self._num_events += 1
        payload = {"type": kind, "sequence_number": self._num_events - 1, **fields}
        return f"event: {kind}\n" + event(payload)

    def _response(self, status: str) -> dict:
        body, truncated = self.body, status == "incomplete"
        return {
            "id": self.response_id, "object": "response", "created_at": int(time.time()),
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "error": None, "model": self.model, "output": self.items,
            "instructions": body.get("instructions"), "previous_response_id":
            body.get("previous_response_id"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {}, "store": body.get("store", True),
            "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
            "reasoning": body.get("reasoning"), "user": None,
            "usage": {"input_tokens": self.num_prompt_tokens,
                      "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                      "output_tokens": self.num_output_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.num_prompt_tokens + self.num_output_tokens},
        }


def _messages(body: dict) -> list[dict]:
    """The request's instructions and input items as chat messages."""
    messages = [{"role": "system", "content": body["instructions"]}] if body.get(
        "instructions") else []
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidRequestError("input must be a string or a list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError(f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role", "user"), "content": _text(item, i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":  # earlier reasoning is not rendered again, as templates do
            raise InvalidRequestError(f"input[{i}] has type {kind!r}; this server takes "
                                      "message, function_call, function_call_output, reasoning")
    return messages


def _text(item: dict, i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{i}].content must be a string or a list of parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in (
                "input_text", "output_text", "text"):
            raise InvalidRequestError(f"input[{i}].content: only text parts are supported")
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def _chat_body(body: dict, messages: list[dict]) -> dict:
    chat = {k: v for k, v in body.items() if k not in RESPONSES_FIELDS}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    text_format = ((body.get("text") or {}).get("format") or {"type": "text"})
    if text_format.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.get("name", "output"), "schema": text_format.get("schema")}}
    elif text_format.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return chat


def _chat_tool(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise InvalidRequestError(f"tools[{i}] is a {kind!r} tool; this server runs function "
                                  "tools only")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if k in tool}
    return {"type": "function", "function": function}


def _assistant_message(parsed: ParsedMessage) -> dict:
    message: dict = {"role": "assistant", "content": parsed.content or ""}
    if parsed.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return message
