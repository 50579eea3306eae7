"""Chat over gRPC: `EngineClient.render_chat` renders as `/v1/chat/completions` does (RenderChat),
and `EngineClient.chat` generates and parses like `LLM.chat`: the parsed message beside the
token ids and logprobs; bad input is INVALID_ARGUMENT."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
import requests

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_engine.protocol import StructuredOutputsParams
from tests.e2e.http_helpers import AGENT_MODEL_NAME
from trainer_bridge import EngineClient, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
    "required": ["query"]}}}]
MESSAGES = [{"role": "user", "content": "find it"}]
ANSWER = ('<think>\nPlan.\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": '
          '"x"}}\n</tool_call>')


@pytest.fixture(scope="module")
def agent_client(agent_server):
    with EngineClient(agent_server.address, timeout=120) as client:
        client.wait_until_ready(30)
        yield client


def test_render_chat_is_the_http_chat_prompt(agent_client, agent_server):
    token_ids, text = agent_client.render_chat(MESSAGES, TOOLS)
    assert text.startswith("<|system|>Tools: search") and text.endswith("<|assistant|>")
    response = requests.post(f"{agent_server.http_url}/v1/chat/completions", timeout=60, json={
        "model": AGENT_MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
        "max_tokens": 1, "return_token_ids": True})
    assert response.json()["prompt_token_ids"] == token_ids


def test_chat_parses_beside_the_raw_tokens(agent_client):
    forced = SamplingParams(temperature=0.0, max_tokens=120, logprobs=0,
                            structured_outputs=StructuredOutputsParams(choice=[ANSWER]))
    (output,) = agent_client.chat(MESSAGES, forced, tools=TOOLS, tool_parser="hermes",
                                  reasoning_parser="qwen3", enable_in_reasoning=True)
    (completion,) = output.outputs
    assert completion.text == ANSWER and len(completion.logprobs) == len(completion.token_ids)
    assert completion.message.reasoning == "Plan." and completion.message.content is None
    (call,) = completion.message.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("search", {"query": "x"})


def test_required_calls_over_grpc_parse_and_validate(agent_client):
    params = SamplingParams(n=32, temperature=1.0, seed=4, max_tokens=120)
    (output,) = agent_client.chat(MESSAGES, params, tools=TOOLS, tool_parser="hermes",
                                  tool_choice="required", parallel_tool_calls=False)
    for completion in output.outputs:
        (call,) = completion.message.tool_calls
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])


def test_bad_render_requests_are_invalid_argument(agent_server):
    with grpc.insecure_channel(agent_server.address) as channel:
        stub = pb_grpc.RolloutEngineStub(channel)
        for request, message in [
            (pb.RenderChatRequest(messages_json="[{"), "not valid JSON"),
            (pb.RenderChatRequest(messages_json="{}"), "must be a JSON list"),
            (pb.RenderChatRequest(messages_json="[]"), "at least one message"),
            (pb.RenderChatRequest(messages_json=json.dumps(MESSAGES), tools_json="[1]"),
             "tools"),
        ]:
            with pytest.raises(grpc.RpcError) as error:
                stub.RenderChat(request)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.value.details(), error.value.details()


def test_token_in_over_grpc(agent_client):
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=10,
                            allowed_token_ids=list(range(2, 512)))
    (first,) = agent_client.chat(MESSAGES, params)
    history = first.prompt_token_ids + first.outputs[0].token_ids
    turn = [*MESSAGES, {"role": "assistant", "content": first.outputs[0].text},
            {"role": "user", "content": "again"}]
    (second,) = agent_client.chat(turn, params, tokens=history)
    assert second.prompt_token_ids[:len(history)] == history
    token_ids, _ = agent_client.render_chat(turn, tokens=history)
    assert token_ids == second.prompt_token_ids
