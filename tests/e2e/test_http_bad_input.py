"""Bad input over HTTP: every bad request gets its status and error JSON, a dropped stream and a
client that hangs up give back their KV blocks and admission at once, HTTP and gRPC share one
admission limit, work a request makes expensive (its chat template, a huge prompt) leaves
`/health` and gRPC answering, and a fuzz run never sees a 500 or a stalled `/health` and leaves
the server serving the Hugging Face model's tokens.

Two servers for the module, both with an API key and small limits (16 samples in flight,
n <= 8, 1 MiB bodies, 32-token model length) so that the fuzz cannot ask for long work: one
trusts request chat templates (`--trust-request-chat-template`), the other does not."""

from __future__ import annotations

import collections
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import requests
from safetensors.torch import load_file

from rollout_engine.protocol import AdmissionError
from tests.e2e.http_helpers import HealthProbe
from tests.e2e.server_process import start_server, wait_for
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import EngineClient, SamplingParams

API_KEY = "http-secret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 32
TIMEOUT_S = 30
# vLLM 0.32's words (`vllm serve`, recorded against it): its answer to a request template
# it does not trust, and its log line for ignored fields (a debug line there, a warning here).
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is "
                      "not set. Refused request with untrusted chat template.")
IGNORED_WARNING = "The following fields were present in the request but ignored"


SMALL_LIMITS = ("--http-port", "0", "--api-key", API_KEY, "--max-inflight-requests", "16",
                "--max-n", "8", "--max-message-bytes", "1MiB", "--max-model-len",
                str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def http_server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, *SMALL_LIMITS,
                           "--trust-request-chat-template")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def grpc_client(http_server):
    with EngineClient(http_server.address, timeout=60) as engine_client:
        yield engine_client


@pytest.fixture(scope="module")
def untrusting_server(tmp_path_factory, llama_dir):
    """The same limits, and request chat templates refused (vLLM's default)."""
    process = start_server(tmp_path_factory, llama_dir, *SMALL_LIMITS)
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def untrusting_grpc_client(untrusting_server):
    with EngineClient(untrusting_server.address, timeout=60) as engine_client:
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
    # Text no tokenizer takes: a lone surrogate, sent as JSON's escape.
    ("lone surrogate in a prompt", "POST", "/v1/completions", {**COMPLETION, "prompt":
     "caf\u00e9 \ud800"}, AUTH, 400, "the prompt holds a lone surrogate ('\\ud800' at character 5)"),
    ("lone surrogate in a message", "POST", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "hi \udfff"}]}, AUTH, 400, "the chat prompt"),
    ("lone surrogate in bad_words", "POST", "/v1/completions", {**COMPLETION, "bad_words": [
     "ok", "\ud83d"]}, AUTH, 400, "bad_words[1] holds a lone surrogate"),
    ("lone surrogate to tokenize", "POST", "/tokenize", {"prompt": "\ud800"}, AUTH, 400,
     "lone surrogate"),
    ("lone surrogate in messages to tokenize", "POST", "/tokenize", {"messages": [
        {"role": "user", "content": "\ud800"}], "chat_template": CHAT["chat_template"]}, AUTH,
     400, "lone surrogate"),
    ("lone surrogate in a regex", "POST", "/v1/completions", {**COMPLETION,
     "structured_outputs": {"regex": "a\ud800"}}, AUTH, 400,
     "structured_outputs.regex holds a lone surrogate"),
    ("lone surrogate in the model name", "POST", "/v1/completions", {**COMPLETION, "model":
     "\ud800"}, AUTH, 404, "does not exist"),
    ("nested 100,000 deep", "POST", "/v1/completions", b'{"prompt": [1], "x": ' + b"[" * 100_000
     + b"]" * 100_000 + b"}", AUTH, 400, "nested too deeply"),
    ("NaN temperature", "POST", "/v1/completions", b'{"prompt": [5], "temperature": NaN}', AUTH,
     400, "finite number"),
    ("Infinity top_p", "POST", "/v1/completions", b'{"prompt": [5], "top_p": Infinity}', AUTH,
     400, "finite number"),
    ("text too long for the model", "POST", "/v1/completions", {**COMPLETION, "prompt":
     "the " * 5000}, AUTH, 400, "maximum context length is 32 tokens"),
    ("request template too long", "POST", "/v1/chat/completions", {**CHAT, "chat_template":
     "x" * 70_000}, AUTH, 400, "at most 65536"),
    ("named tool not among tools", "POST", "/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, AUTH, 400,
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
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
    for path, body in (("/v1/completions", {"prompt": "the " * 5000}),  # too long, truncated
                       ("/v1/chat/completions", {**CHAT, "messages": [
                           {"role": "user", "content": "the " * 5000}]})):
        truncated = call(http_server, "POST", path, {
            **body, "truncate_prompt_tokens": 4, "max_tokens": 2, "ignore_eos": True})
        assert truncated.status_code == 200, truncated.text
        assert truncated.json()["usage"]["prompt_tokens"] == 4


def test_unknown_fields_are_ignored_with_one_warning_naming_them(http_server):
    """As vLLM: 200, and one line in the log per request (a typo is seen there)."""
    num_warned = http_server.log().count(IGNORED_WARNING)
    fields = {"temprature": 0, "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
              "stream_options": {"include_usage": True, "bogus": 1}, "stream": True}
    response = call(http_server, "POST", "/v1/completions", {**COMPLETION, **fields})
    assert response.status_code == 200, response.text
    assert wait_for(lambda: http_server.log().count(IGNORED_WARNING) == num_warned + 1)
    (line,) = [x for x in http_server.log().splitlines() if IGNORED_WARNING in x][num_warned:]
    assert all(f"'{name}'" in line for name in (
        "temprature", "metadata", "store", "service_tier", "stream_options.bogus")), line


def test_request_templates_need_the_trust_flag(untrusting_server):
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {
            "messages": CHAT["messages"], "chat_template": CHAT["chat_template"]})):
        response = call(untrusting_server, "POST", path, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == UNTRUSTED_TEMPLATE, response.text
    assert call(untrusting_server, "GET", "/tokenizer_info").status_code == 404  # not enabled


SLOW_TEMPLATE = "{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}"
"""Seconds of rendering in 78 bytes (it renders nothing: the answer is 400)."""


def test_expensive_requests_leave_health_and_grpc_answering(http_server, grpc_client):
    """A trusted template that renders for seconds, a 1 MB prompt the model cannot take, a 1 MB
    text to count and 300k ids to decode: `/health` and gRPC answer meanwhile (they waited
    seconds before)."""
    work = [("/v1/chat/completions", {**CHAT, "chat_template": SLOW_TEMPLATE}, 400),
            ("/v1/completions", {"prompt": "the " * 250_000, "max_tokens": 1}, 400),
            ("/tokenize", {"prompt": "the " * 250_000}, 200),
            ("/detokenize", {"tokens": [5] * 300_000}, 200)]
    grpc_latencies_s = []
    with HealthProbe(http_server.http_url) as probe, ThreadPoolExecutor(len(work)) as pool:
        answers = [pool.submit(call, http_server, "POST", path, body) for path, body, _ in work]
        while not all(answer.done() for answer in answers):
            start = time.monotonic()
            grpc_client.info()
            grpc_latencies_s.append(time.monotonic() - start)
            time.sleep(0.02)
    grpc_latencies_s.sort()
    grpc_p50_s, grpc_p99_s = (grpc_latencies_s[int(q * len(grpc_latencies_s))] for q in (0.5, 0.99))
    print(f"\n{probe.summary()}; gRPC GetInfo: {len(grpc_latencies_s)} calls, p50 "
          f"{grpc_p50_s * 1e3:.1f} ms, p99 {grpc_p99_s * 1e3:.1f} ms, max "
          f"{grpc_latencies_s[-1] * 1e3:.1f} ms")
    for answer, (path, _, status) in zip(answers, work):
        assert answer.result().status_code == status, (path, answer.result().text)
    assert probe.statuses == {200}
    # Generous bounds for a busy machine; on the event loop the medians were seconds.
    assert probe.quantile_s(0.5) < 0.25 and probe.quantile_s(0.99) < 1.0, probe.summary()
    assert grpc_p50_s < 0.25 and grpc_p99_s < 1.0


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
    ("POST", "/tokenize", {"messages": CHAT["messages"], "chat_template": CHAT["chat_template"]}),
    ("GET", "/tokenizer_info", None),
]
FIELDS = ["prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs",
          "stop", "stream", "echo", "logit_bias", "structured_outputs", "response_format",
          "messages", "top_logprobs", "prompt_logprobs", "min_tokens", "stop_token_ids",
          "tools", "tool_choice", "return_token_ids", "bad_words", "allowed_token_ids",
          "chat_template", "chat_template_kwargs", "metadata", "tokens"]


def nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = {"a": [leaf]}
    return leaf


VALUES = [0, 1, -1, 2, 8, 9, 31, 2**31, -(2**63), 1.5, -0.0, 1e308, "", "x", "\u00e9\u4e2d",
          None, True, [], [1, 2], [[3, 4]], {}, {"regex": "[a-z]+"}, {"json": {"type": "object"}},
          {"type": "json_object"}, [{"role": "user", "content": "hi"}], {"1": 100},
          # Text no tokenizer takes, numbers JSON does not have, nesting Python cannot follow
          "a\ud800", ["\udfff"], [{"role": "user", "content": "\ud800"}], {"\ud800": 1},
          {"regex": "\ud800"}, {"choice": ["a", "\udfff"]}, {"grammar": "start: \"\ud800\""},
          {"json": {"const": "\ud800"}}, {"type": "json_schema", "json_schema": {"schema": {
              "const": "\ud800"}}},
          float("nan"), float("inf"), [float("-inf")], nested(300), {"json": nested(300)},
          [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]]
# Templates a request may send: slow, recursive, huge, hostile or broken.
TEMPLATES = [
    "{% for i in range(1500) %}{% for j in range(1500) %}{% endfor %}{% endfor %}x",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% for i in range(20000) %}{{ messages }}{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}", "{{ raise_exception('no') }}",
    "{% for %}", "{{ messages | tojson }}", "{{ tools | tojson }}{{ messages[0].content }}",
    "x" * 70_000, "",
]
QUERIES = ["", "?level=1", "?level=2&mode=wait", "?level=x", "?tags=weights", "?tags=kv_cache",
           "?tags=bogus", "?mode=abort", "?level=1&mode=keep"]
ALLOWED_STATUSES = {200, 400, 401, 404, 405, 409, 413, 429, 501, 503}


def fuzz_request(rng: random.Random):
    method, path, template = rng.choice(FUZZ_TARGETS)
    if template is None:
        return method, path + rng.choice(QUERIES), None
    if rng.random() < 0.03:
        depth = rng.choice([900, 100_000])
        return method, path, b'{"prompt": [1], "x": ' + b"[" * depth + b"]" * depth + b"}"
    body = dict(template)
    for _ in range(rng.randint(0, 4)):
        name = rng.choice(FIELDS)
        body[name] = rng.choice(TEMPLATES if name == "chat_template" else VALUES)
    if rng.random() < 0.2:
        body.pop(rng.choice(list(body)), None)
    raw = json.dumps(body).encode()  # NaN and Infinity as Python's json (and vLLM) reads them
    if rng.random() < 0.2:  # byte-level damage
        pos = rng.randrange(len(raw))
        raw = raw[:pos] + rng.randbytes(rng.randint(0, 4)) + raw[pos + rng.randint(0, 4):]
    return method, path, raw


@pytest.mark.parametrize("server_name, num_calls", [
    ("http_server", 500), ("untrusting_server", 200),
    pytest.param("http_server", 5000, marks=pytest.mark.slow)],
    ids=["short", "short-untrusting", "long"])
def test_fuzzed_requests_get_statuses_and_the_server_serves_after(request, llama_dir,
                                                                  server_name, num_calls):
    """Never a 500, never a stalled `/health` (timed from a thread of its own meanwhile)."""
    server = request.getfixturevalue(server_name)
    client = request.getfixturevalue(
        "grpc_client" if server_name == "http_server" else "untrusting_grpc_client")
    rng = random.Random(num_calls)
    statuses: collections.Counter = collections.Counter()
    start = time.monotonic()
    with HealthProbe(server.http_url) as probe:
        for i in range(num_calls):
            method, path, body = fuzz_request(rng)
            headers = AUTH if rng.random() < 0.95 else {
                "Authorization": rng.choice(["", "Bearer"])}
            response = call(server, method, path, body, headers)
            statuses[response.status_code] += 1
            assert response.status_code in ALLOWED_STATUSES, (i, path, body, response.text)
            assert server.process.poll() is None, f"the server died at call {i}"
    print(f"\nHTTP fuzz ({server_name}): {num_calls} calls in {time.monotonic() - start:.1f} s, "
          f"statuses {dict(sorted(statuses.items()))}; {probe.summary()}")
    assert probe.statuses == {200}
    assert probe.quantile_s(0.99) < 1.0, probe.summary()
    client.wake_up()  # the fuzz may have left it asleep, weights discarded (level 2)
    client.update_weights(load_file(str(llama_dir / "model.safetensors")), transport="stream")
    prompts = [[5 + i, 17, 99, 250, 7, 31] for i in range(3)]
    response = call(server, "POST", "/v1/completions", {
        "prompt": prompts, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert [c["token_ids"] for c in response.json()["choices"]] == hf_greedy_batch(
        str(llama_dir), prompts, 8)
    assert_all_free(client)
