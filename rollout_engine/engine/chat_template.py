"""Chat messages to prompt token ids, as `vllm serve` renders them: the tokenizer's chat template
(or the request's, rendered in transformers' sandboxed Jinja environment) with `tools`,
`documents`, `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`, to
text, then tokenized without special tokens unless `add_special_tokens`. The same ids as
`tokenizer.apply_chat_template(..., tokenize=True)`.

As vLLM: `developer` messages become `system` ones for a template that does not know the role,
and tools reach the template as `{"type": "function", "function": {"name", "description",
"parameters"}}` and nothing else. Rendering is blocking work: the server runs it off its event
loop (`ServingContext.render_chat`); `LLM.chat` renders a `ChatPrompt` with the same code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout_engine.engine.prompt_text import check_prompt_length, check_text
from rollout_engine.protocol import InvalidRequestError

if TYPE_CHECKING:
    from rollout_engine.engine.input_processor import InputProcessor

# Arguments the server passes itself: chat_template_kwargs may not override them.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                              "add_generation_prompt", "continue_final_message", "tokenize"})


UNTRUSTED_TEMPLATE_MESSAGE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template.")
"""vLLM's words, for a request that brings its own template to a server that runs none."""


@dataclass
class RenderedChat:
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation and the options `render_chat` reads (the HTTP chat request carries the
    same fields)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    reasoning_effort: str | None = None


def render_chat(processor: InputProcessor, request, fit_model: bool = True) -> RenderedChat:
    """The prompt of a chat request (ChatPrompt, ChatCompletionRequest or TokenizeChatRequest);
    InvalidRequestError for messages, tools or a template that cannot render, and with
    `fit_model` for a prompt too long for the model in any tokenization."""
    tokenizer = processor.tokenizer
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
    tools = [_tool(tool, i) for i, tool in enumerate(request.tools)] if request.tools else None
    try:
        if any(m["role"] == "developer" for m in messages) and not _knows_developer(
                tokenizer.get_chat_template(request.chat_template, tools)):
            messages = _consolidate_system(_developer_as_system(messages))
        text = tokenizer.apply_chat_template(
            messages, tools=tools, documents=request.documents,
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template, message or tool the user sent
        raise InvalidRequestError(
            f"cannot render the chat template: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template rendered no text")
    what = "the chat prompt (messages rendered by the chat template)"
    check_text(text, what)
    if fit_model:
        check_prompt_length(text, processor.max_prompt_chars, processor.max_model_len, what)
    token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    if not token_ids:
        raise InvalidRequestError("the chat template rendered an empty prompt")
    return RenderedChat(text, token_ids)


def _knows_developer(template: str) -> bool:
    """vLLM's test: the template names the role."""
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`developer` messages (OpenAI's newer clients send them) as `system` ones, as vLLM
    renders them for templates without the role; a developer message's own tools go."""
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    return converted


def _consolidate_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's: several system messages, or one not first, become one first message with their
    non-empty contents joined by blank lines (templates often take only a first system)."""
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if systems in ([], [0]):
        return messages
    contents = [messages[i].get("content") for i in systems]
    merged = {"role": "system", "content": "\n\n".join(c for c in contents if c)}
    return [merged, *(m for m in messages if m["role"] != "system")]


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """A tool as vLLM hands it to the template: only the fields of OpenAI's function tool,
    `description` and `parameters` as null when not given, `strict` when given."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\": ...}}")
    if not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"tools[{i}].function needs a string `name`")
    kept = {"name": function["name"], "description": function.get("description"),
            "parameters": function.get("parameters")}
    for optional in ("strict", "defer_loading"):
        if function.get(optional) is not None:
            kept[optional] = function[optional]
    return {"type": "function", "function": kept}


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


def extend_tokens(processor: InputProcessor, request, rendered: RenderedChat,
                  tokens: list[int]) -> RenderedChat:
    """Token-in chat (prime-rl's `/v1/chat/completions/tokens`): the prompt is `tokens` (the
    previous turn's prompt and completion ids, as sampled) followed by the tokens of what the
    template renders after the last assistant message (the new tool and user messages, the
    generation prompt), so earlier turns are never tokenized again.

    `rendered` is `request` (the conversation, last assistant message included) rendered. Where
    it starts with the text of `tokens`, the new part is what follows. Otherwise the template
    renders the sampled answer its own way (tool-call JSON re-serialised, a stray space), and
    the new part is what it renders after the assistant's end of turn: the conversation up to
    the last assistant message must render as a prefix of the whole one (the template only
    appends), and that message must end with the last token of `tokens` (the end-of-turn token
    the model sampled) and nothing but whitespace. A bridge that cannot be built so is an
    InvalidRequestError saying why, never a silent re-render."""
    if not tokens or not all(isinstance(t, int) and 0 <= t < processor.vocab_size
                             for t in tokens):
        raise InvalidRequestError("tokens must be a non-empty list of this model's token ids")
    before = processor.tokenizer.decode(tokens, skip_special_tokens=False)
    if rendered.text.startswith(before):
        suffix = rendered.text[len(before):]
    else:
        suffix = _after_last_answer(processor, request, rendered.text, tokens[-1], before)
    new_ids = processor.tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
    return RenderedChat(rendered.text, list(tokens) + new_ids)


def _after_last_answer(processor: InputProcessor, request, text: str, last_token: int,
                       before: str) -> str:
    """What the template renders after the last assistant message's end of turn."""
    last = max((i for i, m in enumerate(request.messages) if m.get("role") == "assistant"),
               default=None)
    if last is None:
        at = next((i for i, (a, b) in enumerate(zip(before, text)) if a != b),
                  min(len(before), len(text)))
        raise InvalidRequestError(
            "the chat template does not extend `tokens`, and the messages hold no assistant "
            f"message to bridge after: at character {at} the rendered conversation has "
            f"{text[at:at + 40]!r} where the tokens decode to {before[at:at + 40]!r}")
    head = render_chat(processor, ChatPrompt(
        list(request.messages[:last + 1]), getattr(request, "tools", None),
        getattr(request, "documents", None), getattr(request, "chat_template", None),
        getattr(request, "chat_template_kwargs", None), add_generation_prompt=False,
        reasoning_effort=getattr(request, "reasoning_effort", None)), fit_model=False).text
    if not text.startswith(head):
        raise InvalidRequestError(
            "the chat template rewrites earlier turns when later messages follow (the "
            "conversation up to the last assistant message does not render as a prefix of the "
            "whole one); token in cannot bridge it")
    end = processor.tokenizer.decode([last_token], skip_special_tokens=False)
    at = head.rfind(end) if end.strip() else -1
    if at < 0 or head[at + len(end):].strip():
        raise InvalidRequestError(
            f"`tokens` end with {end!r}, which is not how the chat template ends the last "
            f"assistant message ({head[-40:]!r}); send the previous turn's prompt and "
            "completion ids as they were, ending with the model's end-of-turn token")
    return text[at + len(end):]
