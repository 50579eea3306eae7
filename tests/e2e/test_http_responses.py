"""`POST /v1/responses` on the shared agent server, through the `openai` package's
`responses.create` and openai-agents' default (Responses) model: function calls come back as
`function_call` items, tool outputs go back in with `previous_response_id`, and what the API
has that this server does not run is refused with 400."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.http_helpers import AGENT_MODEL_NAME

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Tokyo"]}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def oai(agent_server):
    with openai.OpenAI(base_url=f"{agent_server.http_url}/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        yield client


def test_a_call_then_its_output_through_previous_response_id(oai):
    first = oai.responses.create(model=AGENT_MODEL_NAME, instructions="Use the tools.",
                                 input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=120)
    assert first.status == "completed" and first.id.startswith("resp_")
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Tokyo")
    second = oai.responses.create(
        model=AGENT_MODEL_NAME, previous_response_id=first.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}],
        max_output_tokens=40, extra_body={"structured_outputs": {"choice": ["It is 22 C."]}})
    assert second.output_text == "It is 22 C."
    assert [item.type for item in second.output] == ["message"]
    # The whole conversation was the second prompt: instructions, question, call, output.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_what_this_server_does_not_run_is_refused(oai):
    for fields, message in [
        ({"stream": True}, "not supported yet"),
        ({"previous_response_id": "resp_unknown"}, "unknown here"),
        ({"tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": [{"type": "image_generation_call"}]}, "this server takes"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            oai.responses.create(model=AGENT_MODEL_NAME, **{"input": "hi", **fields})


def test_an_openai_agents_agent_on_its_default_responses_model(agent_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    from tests.e2e.test_agent_clients import CITIES, calls_made, get_weather

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{agent_server.http_url}/v1", api_key="unused")
    agent = Agent(name="weather", instructions="Answer with the tool's result.",
                  tools=[function_tool(get_weather)],
                  model=OpenAIResponsesModel(model=AGENT_MODEL_NAME, openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=96))
    calls_made.clear()
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert len(calls_made) == 1 and calls_made[0] in CITIES
    assert isinstance(result.final_output, str)
