"""Tool calls and reasoning through a real `serve --http-port --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3` (the shared `agent_server`), with the
`openai` package: forced output
(a structured-outputs choice makes the random model write an exact answer) comes back parsed,
streamed and not; "required" and named tool choices make a random model at temperature 1 write
calls in hermes' own format that all parse and validate against their schemas."""

from __future__ import annotations

import collections
import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.http_helpers import CHAT_TEMPLATE

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 16}},
        "required": ["query"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>")
ANSWER = "<think>\nThe user wants weather.\n</think>\n\nLet me look." + CALL


@pytest.fixture(scope="module")
def oai(agent_server):
    with openai.OpenAI(base_url=f"{agent_server.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as http_client:
        yield http_client


def create(oai, **fields):
    extra = {"chat_template": CHAT_TEMPLATE, "return_token_ids": True,
             **fields.pop("extra_body", {})}
    return oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MESSAGES,
                                       tools=TOOLS, extra_body=extra, **fields)


def forced(answer: str) -> dict:
    return {"structured_outputs": {"choice": [answer]}}


def test_a_forced_answer_comes_back_parsed_streamed_and_not(oai, llama_dir):
    whole = create(oai, max_tokens=150, extra_body=forced(ANSWER))
    (choice,) = whole.choices
    message = choice.message
    assert message.reasoning == "The user wants weather."  # vLLM's field, and its alias
    assert message.model_extra["reasoning_content"] == message.reasoning
    assert message.content == "Let me look."
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert choice.finish_reason == "tool_calls"
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert tokenizer.decode(choice.token_ids[:-1]) == ANSWER  # the raw tokens beside the view

    content, reasoning, calls, reasons = "", "", [], []
    for chunk in create(oai, max_tokens=150, stream=True, extra_body=forced(ANSWER)):
        for streamed in chunk.choices:
            content += streamed.delta.content or ""
            reasoning += (streamed.delta.model_extra or {}).get("reasoning") or ""
            calls += streamed.delta.tool_calls or []
            reasons.append(streamed.finish_reason)
    assert (content, reasoning) == (message.content, message.reasoning)
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", call.function.arguments)]
    assert calls[0].id.startswith("chatcmpl-tool-") and reasons[-1] == "tool_calls"


def test_an_answer_without_calls_is_content(oai):
    (choice,) = create(oai, max_tokens=50, extra_body=forced("Sunny, 22 C.")).choices
    assert choice.message.content == "Sunny, 22 C." and choice.message.tool_calls == []
    assert choice.message.reasoning is None and choice.finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                       "function": {"name": "search"}}])
def test_constrained_calls_from_a_random_model_all_parse_and_validate(oai, llama_dir,
                                                                       tool_choice):
    """200 samples at temperature 1: every one a single call in hermes' format, whose
    arguments match the tool's JSON Schema."""
    n = 200
    response = create(oai, n=n, temperature=1.0, seed=5, max_tokens=180,
                      tool_choice=tool_choice, parallel_tool_calls=False)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    names = collections.Counter()
    for choice in response.choices:
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert tokenizer.decode(choice.token_ids).startswith('<tool_call>\n{"name": "')
        names[call.function.name] += 1
    assert sum(names.values()) == n
    if tool_choice == "required":
        assert set(names) == {"get_weather", "search"}, names
    else:
        assert set(names) == {"search"}


def test_streamed_constrained_calls_add_up_to_whole_calls(oai):
    calls = collections.defaultdict(list)
    for chunk in create(oai, n=4, temperature=1.0, seed=3, max_tokens=180, stream=True,
                        tool_choice="required", parallel_tool_calls=False):
        for choice in chunk.choices:
            calls[choice.index] += choice.delta.tool_calls or []
    assert sorted(calls) == [0, 1, 2, 3]
    for deltas in calls.values():
        (call,) = deltas
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choices_that_cannot_be_honoured_are_refused(oai):
    with pytest.raises(openai.BadRequestError, match="structured_outputs or response_format"):
        create(oai, max_tokens=5, tool_choice="required",
               response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="at least one tool"):
        oai.chat.completions.create(model=oai.models.list().data[0].id, messages=MESSAGES,
                                    tool_choice="required", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="does not match any"):
        create(oai, max_tokens=5, tool_choice={"type": "function", "function": {"name": "x"}})
