"""`POST /v1/responses` (OpenAI's Responses API, which `vllm serve` answers and openai-agents'
default model class speaks), over the chat pipeline: the input items become chat messages
(instructions first; `function_call` and `function_call_output` items as the assistant's calls
and the tool's answers), function tools become chat tools, and the parsed answer comes back as
`reasoning`, `message` and `function_call` output items. `previous_response_id` continues a
conversation this server answered (the last `MAX_STORED_RESPONSES` are kept in memory).

Refused, saying so: streaming (`stream: true`), `background`, hosted tools (web search, file
search, ...), `conversation` and stored `prompt` templates."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.parsing import ParsedMessage
from rollout_engine.protocol import InvalidRequestError, RequestOutputKind
from rollout_engine.server.http.api_models import ChatCompletionRequest
from rollout_engine.server.http.chat_tools import ChatTools
from rollout_engine.server.http.context import serving
from rollout_engine.server.http.error_responses import json_response
from rollout_engine.server.http.generation import parse_body, read_json_object, until_disconnected
from rollout_engine.server.http.sampling import chat_params

router = APIRouter()
MAX_STORED_RESPONSES = 1024
RESPONSES_FIELDS = frozenset({
    "input", "instructions", "tools", "tool_choice", "max_output_tokens", "previous_response_id",
    "store", "reasoning", "text", "stream", "background", "conversation", "prompt", "include",
    "metadata", "truncation", "service_tier", "prompt_cache_key", "safety_identifier",
    "max_tool_calls", "top_logprobs", "stream_options", "user"})
"""The Responses API's own fields; the others (model, temperature, top_p, vLLM's sampling
extras such as `seed` or `structured_outputs`) are the chat request's."""
REFUSED = {"stream": "streamed responses are not supported yet; send stream false",
           "background": "background responses are not supported",
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
    ctx.check_model(request.model)
    tools = ChatTools.for_request(request, ctx.config)
    prompt = await ctx.render_chat(tools.prompt_request())
    params = tools.constrain(chat_params(request, len(prompt.token_ids), ctx.max_model_len),
                             prompt.text)
    generation = ctx.engine.generate([prompt.token_ids], [params], RequestOutputKind.FINAL_ONLY,
                                     "resp")
    (output,) = await until_disconnected(raw_request, generation.final_outputs())
    (completion,) = output.outputs
    parser = tools.parser(prompt.text)
    parsed = parser.parse(completion.text) if parser else ParsedMessage(completion.text, None)
    response_id = f"resp_{uuid.uuid4().hex}"
    if body.get("store", True):
        store.put(response_id, [*messages, _assistant_message(parsed)])
    return json_response(_response(body, response_id, ctx.model_name, parsed,
                                   completion.finish_reason, len(output.prompt_token_ids),
                                   len(completion.token_ids)))


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


def _response(body: dict, response_id: str, model: str, parsed: ParsedMessage,
              finish_reason: str | None, num_prompt_tokens: int, num_output_tokens: int) -> dict:
    output: list[dict] = []
    if parsed.reasoning:
        output.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": parsed.reasoning}]})
    if parsed.content:
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                       "status": "completed", "content": [
                           {"type": "output_text", "text": parsed.content, "annotations": [],
                            "logprobs": []}]})
    for call in parsed.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                       "call_id": call.id, "name": call.name, "arguments": call.arguments,
                       "status": "completed"})
    truncated = finish_reason == "length"
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if truncated else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "error": None, "model": model, "output": output,
        "instructions": body.get("instructions"), "previous_response_id":
        body.get("previous_response_id"), "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "metadata": body.get("metadata") or {}, "store": body.get("store", True),
        "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
        "reasoning": body.get("reasoning"), "user": None,
        "usage": {"input_tokens": num_prompt_tokens,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": num_output_tokens,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": num_prompt_tokens + num_output_tokens},
    }
