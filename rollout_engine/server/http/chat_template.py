"""Chat messages to prompt token ids, as `vllm serve` renders them: the tokenizer's chat template
(or the request's, rendered in transformers' sandboxed Jinja environment) with `tools`,
`documents`, `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`, to
text, then tokenized without special tokens unless `add_special_tokens`. The same ids as
`tokenizer.apply_chat_template(..., tokenize=True)`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollout_engine.protocol import InvalidRequestError

# Arguments the server passes itself: chat_template_kwargs may not override them.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                              "add_generation_prompt", "continue_final_message", "tokenize"})


@dataclass
class RenderedChat:
    text: str
    token_ids: list[int]


def render_chat(tokenizer, request) -> RenderedChat:
    """The prompt of a chat request (ChatCompletionRequest or TokenizeChatRequest);
    InvalidRequestError for messages, tools or a template that cannot render."""
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer to render chat messages with")
    if request.continue_final_message and request.add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot "
                                  "both be true; set add_generation_prompt to false")
    kwargs = dict(request.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}; use the "
                                  "request's own fields")
    reasoning_effort = getattr(request, "reasoning_effort", None)
    if reasoning_effort is not None:  # vLLM's: the template reads it; thinking follows it
        kwargs.setdefault("reasoning_effort", reasoning_effort)
        kwargs.setdefault("enable_thinking", reasoning_effort != "none")
    messages = [_message(m, i) for i, m in enumerate(request.messages)]
    if request.continue_final_message and messages[-1].get("role") != "assistant":
        raise InvalidRequestError("continue_final_message needs the last message to be the "
                                  "assistant's")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=request.tools or None, documents=request.documents,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template, message or tool the user sent
        raise InvalidRequestError(
            f"cannot render the chat template: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template rendered no text")
    token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    if not token_ids:
        raise InvalidRequestError("the chat template rendered an empty prompt")
    return RenderedChat(text, token_ids)


def _message(message: dict[str, Any], i: int) -> dict[str, Any]:
    """One message as Hugging Face templates take it (vLLM's "string" content format): text
    parts joined by newlines, tool-call arguments parsed from their JSON strings."""
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequestError(f"messages[{i}] needs a string `role`")
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "\n".join(_text_part(part, i) for part in content)
    elif content is not None and not isinstance(content, str):
        raise InvalidRequestError(f"messages[{i}].content must be a string, a list of text "
                                  "parts, or null")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        message["tool_calls"] = [_tool_call(call, i) for call in tool_calls]
    return message


def _text_part(part: Any, i: int) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(
            part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequestError(f"messages[{i}]: content parts of type {kind!r} are not "
                              "supported (text only: this server serves no multimodal model)")


def _tool_call(call: Any, i: int) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidRequestError(f"messages[{i}].tool_calls entries need a `function` object")
    call = dict(call)
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            raise InvalidRequestError(
                f"messages[{i}]: tool call arguments are not valid JSON: {arguments!r}") from None
    call["function"] = function
    return call
