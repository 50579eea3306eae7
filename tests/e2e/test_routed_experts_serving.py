"""Routed experts served: `serve --enable-return-routed-experts --http-port` on a Qwen3-MoE
returns the in-process engine's experts over gRPC (GenerateBatch, and a Generate stream whose
deltas add the rows read since the last message) and over HTTP as `vllm serve` does (each
choice's `routed_experts`, a base64 `.npy` file of the prompt's rows from
`routed_experts_prompt_start` and the output's), unstreamed and in streamed chunks that add up
to it."""

from __future__ import annotations

import base64
import collections
import io
import json

import numpy as np
import pytest
import requests

from rollout_engine import LLM
from tests.e2e.http_helpers import CHAT_TEMPLATE
from tests.e2e.server_process import start_server
from tests.integration.test_routed_experts import PARAMS, PROMPTS, moe_dir, routing_of  # noqa: F401
from trainer_bridge import EngineClient
from trainer_bridge import SamplingParams as WireSamplingParams

WIRE_PARAMS = WireSamplingParams(max_tokens=PARAMS.max_tokens, temperature=0, ignore_eos=True)
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory, moe_dir):  # noqa: F811
    process = start_server(tmp_path_factory, moe_dir, "--enable-return-routed-experts",
                           "--http-port", "0", "--trust-request-chat-template")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.address, timeout=TIMEOUT_S) as engine_client:
        engine_client.wait_until_ready(30)
        yield engine_client


def decoded(field: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False)


def post(server, path: str, body: dict) -> requests.Response:
    response = requests.post(f"{server.http_url}{path}", json=body, timeout=TIMEOUT_S,
                             stream=bool(body.get("stream")))
    assert response.status_code == 200, response.text
    return response


def streamed_rows(response: requests.Response) -> dict[int, np.ndarray]:
    """Per choice index, the rows of its chunks joined."""
    rows = collections.defaultdict(list)
    for line in response.iter_lines():
        if line and line != b"data: [DONE]":
            for choice in json.loads(line.removeprefix(b"data: "))["choices"]:
                if "routed_experts" in choice:
                    rows[choice["index"]].append(decoded(choice["routed_experts"]))
    return {index: np.concatenate(parts) for index, parts in rows.items()}


def test_grpc_routing_equals_the_engines_batched_and_streamed(client, moe_dir):  # noqa: F811
    expected = LLM(str(moe_dir), enable_return_routed_experts=True).generate(PROMPTS, PARAMS)
    batch = client.generate(PROMPTS, WIRE_PARAMS)
    for want, got in zip(expected, batch):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert np.array_equal(routing_of(got), routing_of(want))
    snapshots = list(client.generate_stream(PROMPTS[1], WIRE_PARAMS))
    want = routing_of(expected[1])
    assert len(snapshots) > 2, "the tokens should arrive in several messages"
    for snapshot in snapshots:  # the prompt's rows from the first message on
        (output,) = snapshot.outputs
        rows = np.concatenate([snapshot.prompt_routed_experts.to_numpy(),
                               output.routed_experts.to_numpy()])
        num_tokens = len(snapshot.prompt_token_ids) + len(output.token_ids)
        assert np.array_equal(rows, want[: num_tokens - 1])  # the deltas' rows, joined
    assert np.array_equal(routing_of(snapshots[-1]), want)


@pytest.mark.parametrize("prompt_start", [0, 3])
def test_completions_return_vllms_routed_experts(server, client, prompt_start):
    body = {"prompt": PROMPTS, "n": 2, **GREEDY, "routed_experts_prompt_start": prompt_start}
    whole = post(server, "/v1/completions", body).json()
    expected = client.generate(PROMPTS, WireSamplingParams(n=2, max_tokens=6, temperature=0,
                                                           ignore_eos=True))
    for i, output in enumerate(expected):
        for j, completion in enumerate(output.outputs):
            choice = whole["choices"][i * 2 + j]
            assert choice["token_ids"] == completion.token_ids
            rows = decoded(choice["routed_experts"])
            assert rows.dtype == np.int16
            assert np.array_equal(rows, np.concatenate([
                output.prompt_routed_experts.to_numpy()[prompt_start:],
                completion.routed_experts.to_numpy()]))
    streamed = streamed_rows(post(server, "/v1/completions", {**body, "stream": True}))
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        assert np.array_equal(streamed[choice["index"]], decoded(choice["routed_experts"]))


def test_chat_returns_vllms_routed_experts(server, client):
    body = {"messages": [{"role": "user", "content": "hi there"}], "n": 2, **GREEDY,
            "chat_template": CHAT_TEMPLATE}
    whole = post(server, "/v1/chat/completions", body).json()
    (expected,) = client.generate([whole["prompt_token_ids"]], WireSamplingParams(
        n=2, max_tokens=6, temperature=0, ignore_eos=True))
    for choice, completion in zip(whole["choices"], expected.outputs):
        assert choice["token_ids"] == completion.token_ids
        assert np.array_equal(decoded(choice["routed_experts"]), np.concatenate([
            expected.prompt_routed_experts.to_numpy(), completion.routed_experts.to_numpy()]))
    streamed = streamed_rows(post(server, "/v1/chat/completions", {**body, "stream": True}))
    for choice in whole["choices"]:
        assert np.array_equal(streamed[choice["index"]], decoded(choice["routed_experts"]))
