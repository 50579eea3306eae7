"""`POST /v1/responses` on the shared agent server, through the `openai` package's
`responses.create` and openai-agents' default (Responses) model: function calls come back as
`function_call` items, tool outputs go back in with `previous_response_id`, and what the API
has that this server does not run is refused with 400."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from tests.e2e.http_helpers import AGENT_MODEL_NAME
from tests.e2e.server_process import wait_for
from tests.e2e.test_agent_clients import run_weather_agent
from trainer_bridge import EngineClient

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


def test_a_streamed_response_sends_the_events_of_its_items(oai):
    forced = ("<think>\nPlan.\n</think>\n\nChecking.\n<tool_call>\n"
              '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')
    fields = {"model": AGENT_MODEL_NAME, "input": "Weather in Tokyo?", "tools": [WEATHER],
              "max_output_tokens": 150, "extra_body": {"structured_outputs": {"choice": [forced]}}}
    whole = oai.responses.create(**fields)
    events = list(oai.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = events[-1].response
    assert [i.type for i in streamed.output] == [i.type for i in whole.output] == [
        "reasoning", "message", "function_call"]
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done == [i.id for i in streamed.output]  # each item opened and closed once
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (text, reasoning) == ("Checking.", "Plan.") and streamed.output_text == "Checking."
    call, whole_call = streamed.output[2], whole.output[2]
    assert (call.name, call.arguments) == (whole_call.name, whole_call.arguments) == (
        "get_weather", '{"city": "Tokyo"}')
    cut = list(oai.responses.create(model=AGENT_MODEL_NAME, input="hi", max_output_tokens=3,
                                    stream=True, extra_body={"ignore_eos": True}))
    assert cut[-1].type == "response.incomplete"  # as OpenAI ends a truncated response
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_what_this_server_does_not_run_is_refused(oai):
    for fields, message in [
        ({"background": True}, "not supported"),
        ({"previous_response_id": "resp_unknown"}, "unknown here"),
        ({"tools": [{"type": "web_search"}]}, "function tools only"),
        ({"input": [{"type": "image_generation_call"}]}, "this server takes"),
    ]:
        with pytest.raises(openai.BadRequestError, match=message):
            oai.responses.create(model=AGENT_MODEL_NAME, **{"input": "hi", **fields})


def test_an_openai_agents_agent_on_its_default_responses_model(agent_server):
    # EOS favoured: the call is constrained whole first, and the free second turn ends at
    # once (a truncated response stops the agent, as OpenAI's does).
    run_weather_agent(agent_server, "OpenAIResponsesModel",
                      extra_body={"logit_bias": {"0": 100}})


def test_a_client_that_hangs_up_mid_stream_frees_its_request(agent_server):
    """Streamed responses and parsed chat streams: the engine drops the request at once."""
    bodies = {
        "/v1/responses": {"model": AGENT_MODEL_NAME, "input": "hi", "stream": True,
                          "max_output_tokens": 400, "ignore_eos": True},
        "/v1/chat/completions": {"model": AGENT_MODEL_NAME, "stream": True, "max_tokens": 400,
                                 "ignore_eos": True, "tools": [{"type": "function",
                                                               "function": WEATHER}],
                                 "messages": [{"role": "user", "content": "hi"}]},
    }
    with EngineClient(agent_server.address, timeout=60) as client:
        for path, body in bodies.items():
            with requests.post(agent_server.http_url + path, json=body, stream=True,
                               timeout=60) as response:
                assert response.status_code == 200
                assert next(line for line in response.iter_lines() if line)
            assert wait_for(lambda: client.info().num_unfinished_requests == 0), path
