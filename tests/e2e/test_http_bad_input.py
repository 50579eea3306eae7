"""Bad input over HTTP: every bad request gets its status and error JSON, a dropped stream and a
client that hangs up give back their KV blocks and admission at once, HTTP and gRPC share one
admission limit, and a fuzz run leaves the server serving the Hugging Face model's tokens.

One server for the module: an API key, small limits (16 samples in flight, n <= 8, 1 MiB
bodies, 32-token model length) so that the fuzz cannot ask for long work."""

from __future__ import annotations

import collections
import json
import random
import socket
import time
from urllib.parse import urlparse

import pytest
import requests
from safetensors.torch import load_file

from rollout_engine.protocol import AdmissionError
from tests.e2e.server_process import start_server, wait_for
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import EngineClient, SamplingParams

API_KEY = "http-secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 32
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def http_server(tmp_path_factory, llama_dir):
    process = start_server(
        tmp_path_factory, llama_dir, "--http-port", "0", "--api-key", API_KEY,
        "--max-inflight-requests", "16", "--max-n", "8", "--max-message-bytes", "1MiB",
        "--max-model-len", str(MAX_MODEL_LEN))
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def grpc_client(http_server):
    with EngineClient(http_server.address, timeout=60) as engine_client:
        yield engine_client


def call(server, method: str, path: str, body=None, headers=AUTH) -> requests.Response:
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    return requests.request(method, server.http_url + path, data=data, timeout=TIMEOUT_S,
                            headers={"content-type": "application/json", **(headers or {})})


def assert_all_free(client: EngineClient) -> None:
    def is_free():
        info = client.info()
        return info.num_inflight_requests == 0 and info.num_free_blocks == info.num_blocks
    assert wait_for(is_free, timeout_s=10), client.info()


COMPLETION = {"prompt": [5, 17, 99], "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
BAD_REQUESTS = [
    # (what, method, path, body, headers, status, words in the message)
    ("no API key", "POST", "/v1/completions", COMPLETION, {}, 401, "API key"),
    ("wrong API key", "GET", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, "key"),
    ("malformed JSON", "POST", "/v1/completions", b'{"prompt": [1, 2', AUTH, 400, "JSON"),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", AUTH, 400, "JSON object"),
    ("unknown field", "POST", "/v1/completions", {**COMPLETION, "temprature": 0}, AUTH, 400,
     "unknown field `temprature`"),
    ("wrong type", "POST", "/v1/completions", {**COMPLETION, "n": "many"}, AUTH, 400, "n:"),
    ("prompt of the wrong type", "POST", "/v1/completions", {"prompt": 5}, AUTH, 400, "prompt"),
    ("huge n", "POST", "/v1/completions", {**COMPLETION, "n": 2**31 - 1}, AUTH, 400, "--max-n"),
    ("past admission", "POST", "/v1/completions", {**COMPLETION, "prompt": [[5]] * 3, "n": 8},
     AUTH, 429, "in-flight"),
    ("oversized body", "POST", "/v1/completions", {"prompt": "x" * (1 << 20)}, AUTH, 413,
     "more than this server takes"),
    ("token outside the vocabulary", "POST", "/v1/completions", {**COMPLETION,
     "prompt": [5, 10**6]}, AUTH, 400, "vocabulary"),
    ("refused field", "POST", "/v1/completions", {**COMPLETION, "use_beam_search": True},
     AUTH, 400, "beam search"),
    ("too long for the model", "POST", "/v1/completions", {**COMPLETION, "max_tokens": 40},
     AUTH, 400, "maximum context length"),
    ("too many logprobs", "POST", "/v1/completions", {**COMPLETION, "logprobs": 21}, AUTH, 400,
     "logprobs"),
    ("prompt logprobs in a stream", "POST", "/v1/completions", {**COMPLETION, "stream": True,
     "prompt_logprobs": 1}, AUTH, 400, "stream"),
    ("message without a role", "POST", "/v1/chat/completions", {**CHAT, "messages": [
        {"content": "hi"}]}, AUTH, 400, "role"),
    ("image content", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user",
     "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, AUTH, 400, "image_url"),
    ("broken chat template", "POST", "/v1/chat/completions", {**CHAT, "chat_template":
     "{% for %}"}, AUTH, 400, "chat template"),
    ("unknown model", "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-5"}, AUTH, 404,
     "does not exist"),
    ("unknown route", "GET", "/v2/nothing", None, AUTH, 404, "Not Found"),
    ("wrong method", "GET", "/v1/completions", None, AUTH, 405, "Method Not Allowed"),
    ("sleep level", "POST", "/sleep?level=3", None, AUTH, 400, "sleep level"),
    ("sleep level type", "POST", "/sleep?level=deep", None, AUTH, 400, "level"),
    ("wake tag", "POST", "/wake_up?tags=gpu", None, AUTH, 400, "unknown memory tag"),
    ("pause mode", "POST", "/pause?mode=later", None, AUTH, 400, "mode"),
    ("weight transfer", "POST", "/init_weight_transfer_engine", {"init_info": {}}, AUTH, 501,
     "trainer_bridge.EngineClient"),
]


def test_bad_requests_get_their_status_and_leave_nothing_behind(http_server, grpc_client):
    assert call(http_server, "GET", "/health", headers={}).status_code == 200  # no key needed
    for what, method, path, body, headers, status, words in BAD_REQUESTS:
        response = call(http_server, method, path, body, headers)
        assert response.status_code == status, (what, response.text)
        error = response.json()["error"]
        assert error["code"] == status and words in error["message"], (what, error)
    assert_all_free(grpc_client)
    greedy = call(http_server, "POST", "/v1/completions", {**COMPLETION, "temperature": 0,
                                                             "ignore_eos": True})
    assert greedy.status_code == 200, greedy.text


def test_one_admission_and_dropped_clients_free_everything(http_server, grpc_client):
    """Generation paused ("keep"): new requests are admitted and wait, so they stay in flight
    for as long as the test needs."""
    long_request = {"prompt": [[5, 17, 99]], "n": 8, "max_tokens": 20, "ignore_eos": True}
    assert call(http_server, "POST", "/pause?mode=keep").json() == {"status": "paused"}
    try:
        assert call(http_server, "GET", "/is_paused").json() == {"is_paused": True}
        with requests.post(http_server.http_url + "/v1/completions", stream=True, headers=AUTH,
                           json={**long_request, "stream": True}, timeout=TIMEOUT_S):
            assert wait_for(lambda: grpc_client.info().num_inflight_requests == 8)
            with pytest.raises(AdmissionError):  # 8 (HTTP) + 3 x 3 (gRPC) > 16
                grpc_client.generate([[5, 6]] * 3, SamplingParams(n=3, max_tokens=2))
        assert_all_free(grpc_client)  # the dropped stream aborted its samples
        # A client that hangs up on a request that is not streamed.
        url = urlparse(http_server.http_url)
        body = json.dumps(long_request).encode()
        with socket.create_connection((url.hostname, url.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\nauthorization: Bearer " + API_KEY.encode() +
                         b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert wait_for(lambda: grpc_client.info().num_inflight_requests == 8)
        assert_all_free(grpc_client)
    finally:
        assert call(http_server, "POST", "/resume").json() == {"status": "resumed"}


# ------------------------------------------------------------------------------------- fuzz

FUZZ_TARGETS = [
    ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/tokenize", {"prompt": "hello"}), ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("POST", "/sleep", None), ("POST", "/wake_up", None), ("GET", "/is_sleeping", None),
    ("POST", "/reset_prefix_cache", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
]
FIELDS = ["prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
          "stop", "stream", "echo", "logit_bias", "structured_outputs", "response_format",
          "messages", "top_logprobs", "prompt_logprobs", "min_tokens", "stop_token_ids",
          "tools", "tool_choice", "return_token_ids", "bad_words", "allowed_token_ids"]
VALUES = [0, 1, -1, 2, 8, 9, 31, 2**31, -(2**63), 1.5, -0.0, 1e308, "", "x", "\u00e9\u4e2d",
          None, True, [], [1, 2], [[3, 4]], {}, {"regex": "[a-z]+"}, {"json": {"type": "object"}},
          {"type": "json_object"}, [{"role": "user", "content": "hi"}], {"1": 100}]
QUERIES = ["", "?level=1", "?level=2&mode=wait", "?level=x", "?tags=weights", "?tags=kv_cache",
           "?tags=bogus", "?mode=abort", "?level=1&mode=keep"]
ALLOWED_STATUSES = {200, 400, 401, 404, 405, 409, 413, 429, 501, 503}


def fuzz_request(rng: random.Random):
    method, path, template = rng.choice(FUZZ_TARGETS)
    if template is None:
        return method, path + rng.choice(QUERIES), None
    body = dict(template)
    for _ in range(rng.randint(0, 4)):
        body[rng.choice(FIELDS)] = rng.choice(VALUES)
    if rng.random() < 0.2:
        body.pop(rng.choice(list(body)), None)
    raw = json.dumps(body).encode()
    if rng.random() < 0.2:  # byte-level damage
        pos = rng.randrange(len(raw))
        raw = raw[:pos] + rng.randbytes(rng.randint(0, 4)) + raw[pos + rng.randint(0, 4):]
    return method, path, raw


@pytest.mark.parametrize("num_calls", [500, pytest.param(5000, marks=pytest.mark.slow)],
                         ids=["short", "long"])
def test_fuzzed_requests_get_statuses_and_the_server_serves_after(http_server, grpc_client,
                                                                  llama_dir, num_calls):
    rng = random.Random(num_calls)
    statuses: collections.Counter = collections.Counter()
    start = time.monotonic()
    for i in range(num_calls):
        method, path, body = fuzz_request(rng)
        headers = AUTH if rng.random() < 0.95 else {"Authorization": rng.choice(["", "Bearer"])}
        response = call(http_server, method, path, body, headers)
        statuses[response.status_code] += 1
        assert response.status_code in ALLOWED_STATUSES, (i, path, body, response.text)
        assert http_server.process.poll() is None, f"the server died at call {i}"
    print(f"\nHTTP fuzz: {num_calls} calls in {time.monotonic() - start:.1f} s, statuses "
          f"{dict(sorted(statuses.items()))}")
    grpc_client.wake_up()  # the fuzz may have left it asleep, weights discarded (level 2)
    grpc_client.update_weights(load_file(str(llama_dir / "model.safetensors")), transport="stream")
    prompts = [[5 + i, 17, 99, 250, 7, 31] for i in range(3)]
    response = call(http_server, "POST", "/v1/completions", {
        "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert [c["token_ids"] for c in response.json()["choices"]] == hf_greedy_batch(
        str(llama_dir), prompts, 8)
    assert_all_free(grpc_client)

