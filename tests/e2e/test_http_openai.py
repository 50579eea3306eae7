"""The `openai` package against `serve --http-port` (the shared server): completions and chat,
streamed and not, n > 1, logprobs; every answer equal to the gRPC path's on the same engine,
and the chat prompt equal to `tokenizer.apply_chat_template`'s with tools."""

from __future__ import annotations

import collections

import openai
import pytest
import requests
from transformers import AutoTokenizer

from tests.e2e.http_helpers import CHAT_TEMPLATE, MESSAGES, WEATHER_TOOL, grpc_params

PROMPTS = [[5, 17, 99, 250, 7], [31, 4, 8, 77, 120, 6, 9]]
SEEDED = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 8}


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as http_client:
        yield http_client


@pytest.fixture(scope="module")
def model_id(oai) -> str:
    (card,) = oai.models.list().data
    assert card.max_model_len == 256  # vLLM's extra field
    return card.id


def test_completions_equal_the_grpc_path(oai, model_id, client):
    response = oai.completions.create(
        model=model_id, prompt=PROMPTS, logprobs=2, **SEEDED,
        extra_body={"ignore_eos": True, "return_token_ids": True,
                    "return_tokens_as_token_ids": True})
    expected = client.generate(PROMPTS, grpc_params(**SEEDED, logprobs=2))
    assert len(response.choices) == 6  # prompt-major: prompt i's sample j at i * n + j
    for i, output in enumerate(expected):
        for j, completion in enumerate(output.outputs):
            choice = response.choices[i * 3 + j]
            assert choice.index == i * 3 + j and choice.prompt_token_ids == PROMPTS[i]
            assert choice.token_ids == completion.token_ids
            assert choice.text == completion.text
            assert choice.logprobs.token_logprobs == completion.logprobs  # bit-exact
            assert choice.logprobs.tokens == [f"token_id:{t}" for t in completion.token_ids]
            for top, entry in zip(choice.logprobs.top_logprobs, completion.top_logprobs,
                                  strict=True):
                expected_top: dict[str, float] = {}  # the sampled token, then the top 2
                for token_id, logprob in zip(entry.token_ids, entry.logprobs):
                    expected_top.setdefault(f"token_id:{token_id}", logprob)
                assert top == expected_top
    assert response.usage.completion_tokens == 48
    assert response.usage.prompt_tokens == sum(map(len, PROMPTS))


def test_streamed_completions_add_up_to_the_unstreamed(oai, model_id):
    fields = {"model": model_id, "prompt": PROMPTS, "logprobs": 0, **SEEDED,
              "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    whole = oai.completions.create(**fields)
    texts, token_ids, logprobs = (collections.defaultdict(list) for _ in range(3))
    chunks = list(oai.completions.create(**fields, stream=True,
                                         stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index].append(choice.text)
            token_ids[choice.index] += choice.token_ids
            logprobs[choice.index] += choice.logprobs.token_logprobs
    assert len(chunks) > 6, "tokens should arrive in several events"
    assert chunks[-1].usage.completion_tokens == 48 and not chunks[-1].choices
    for choice in whole.choices:
        assert "".join(texts[choice.index]) == choice.text
        assert token_ids[choice.index] == choice.token_ids
        assert logprobs[choice.index] == choice.logprobs.token_logprobs


def test_chat_with_tools_renders_the_template_and_equals_the_grpc_path(oai, model_id, client,
                                                                      llama_dir):
    # Both paths compute the prompt afresh: logits of a prefix-cache hit are the same to
    # about 1e-7, not bit for bit (another batch shape), and this compares bits.
    client.reset_prefix_cache()
    response = oai.chat.completions.create(
        model=model_id, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="none",
        logprobs=True, top_logprobs=2, **SEEDED,
        extra_body={"chat_template": CHAT_TEMPLATE, "return_token_ids": True,
                    "ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER_TOOL],
                                             chat_template=CHAT_TEMPLATE,
                                             add_generation_prompt=True, return_dict=False)
    assert response.prompt_token_ids == rendered
    assert "get_weather(city, unit)" in tokenizer.decode(rendered)
    client.reset_prefix_cache()
    (expected,) = client.generate([rendered], grpc_params(**SEEDED, logprobs=2))
    for choice, completion in zip(response.choices, expected.outputs, strict=True):
        assert choice.message.role == "assistant"
        assert choice.message.content == completion.text
        assert choice.token_ids == completion.token_ids
        assert [c.logprob for c in choice.logprobs.content] == completion.logprobs
        assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)


def test_streamed_chat_adds_up_to_the_unstreamed(oai, model_id):
    fields = {"model": model_id, "messages": MESSAGES, **SEEDED, "n": 2,
              "extra_body": {"chat_template": CHAT_TEMPLATE, "return_token_ids": True,
                             "ignore_eos": True}}
    whole = oai.chat.completions.create(**fields)
    contents, token_ids, roles = (collections.defaultdict(list) for _ in range(3))
    for chunk in oai.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            roles[choice.index].append(choice.delta.role)
            contents[choice.index].append(choice.delta.content or "")
            token_ids[choice.index] += getattr(choice, "token_ids", None) or []
    for choice in whole.choices:
        assert roles[choice.index][0] == "assistant"
        assert "".join(contents[choice.index]) == choice.message.content
        assert token_ids[choice.index] == choice.token_ids


def test_bad_requests_raise_the_openai_errors(oai, model_id):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="no-such-model", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match='"auto" tool choice requires'):
        oai.chat.completions.create(model=model_id, messages=MESSAGES, tools=[WEATHER_TOOL],
                                    extra_body={"chat_template": CHAT_TEMPLATE})
    with pytest.raises(openai.BadRequestError, match="at most 20|MAX_LOGPROBS|logprobs"):
        oai.completions.create(model=model_id, prompt="hello", max_tokens=2, logprobs=21)


def test_one_engine_behind_both_front_ends(server, client):
    url = server.http_url
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert requests.get(f"{url}/version", timeout=10).json()["version"]
    info = client.info()
    metrics = requests.get(f"{url}/metrics", timeout=10).text
    assert f'rollout_engine_kv_cache_blocks{{model_name="{info.model}"}} {info.num_blocks}' in (
        metrics)
    assert "rollout_engine_is_sleeping" in metrics and "rollout_engine_requests_total" in metrics
    tokens = requests.post(f"{url}/tokenize", json={"prompt": "the quick brown fox"},
                           timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = requests.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10)
    assert text.json() == {"prompt": "the quick brown fox"}
    greedy = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    before = requests.post(f"{url}/v1/completions", json=greedy, timeout=60).json()
    assert requests.post(f"{url}/sleep?level=1", timeout=30).status_code == 200
    try:
        assert client.memory_state().is_sleeping  # slept over HTTP, seen over gRPC
        assert requests.get(f"{url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        asleep = requests.post(f"{url}/v1/completions", json=greedy, timeout=60)
        assert asleep.status_code == 503
        assert asleep.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        client.wake_up()  # woken over gRPC, seen over HTTP
    assert requests.get(f"{url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    after = requests.post(f"{url}/v1/completions", json=greedy, timeout=60).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_a_truncated_prompt_is_answered_as_the_engine_ran_it(oai, model_id, llama_dir):
    prompt, keep = list(range(30, 50)), 6
    kept = prompt[-keep:]
    fields = {"model": model_id, "prompt": prompt, "max_tokens": 3, "temperature": 0.0,
              "echo": True, "logprobs": 0,
              "extra_body": {"truncate_prompt_tokens": keep, "ignore_eos": True,
                             "return_tokens_as_token_ids": True}}
    whole = oai.completions.create(**fields)
    (choice,) = whole.choices
    assert whole.usage.prompt_tokens == keep and whole.usage.completion_tokens == 3
    tokens, logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
    assert tokens[:keep] == [f"token_id:{t}" for t in kept] and len(tokens) == keep + 3
    assert logprobs[0] is None and all(lp is not None for lp in logprobs[1:])  # its own logprob
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert choice.text.startswith(tokenizer.decode(kept))
    chunks = list(oai.completions.create(**fields, stream=True,
                                         stream_options={"include_usage": True}))
    streamed = [c for chunk in chunks for c in chunk.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [t for c in streamed for t in c.logprobs.tokens] == tokens
    assert [lp for c in streamed for lp in c.logprobs.token_logprobs] == logprobs
    assert chunks[-1].usage.prompt_tokens == keep
    with_ids = oai.completions.create(**{**fields, "extra_body": {
        **fields["extra_body"], "return_token_ids": True}})
    assert with_ids.choices[0].prompt_token_ids == kept
    chat = oai.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=2,
        extra_body={"chat_template": CHAT_TEMPLATE, "truncate_prompt_tokens": keep,
                    "return_token_ids": True, "ignore_eos": True})
    assert chat.usage.prompt_tokens == keep and len(chat.prompt_token_ids) == keep


def test_a_streamed_echo_of_no_tokens_is_the_prompt_alone(oai, model_id):
    fields = {"model": model_id, "prompt": PROMPTS[0], "max_tokens": 0, "echo": True,
              "logprobs": 0, "extra_body": {"return_tokens_as_token_ids": True}}
    (whole,) = oai.completions.create(**fields).choices
    chunks = list(oai.completions.create(**fields, stream=True,
                                         stream_options={"include_usage": True}))
    streamed = [c for chunk in chunks for c in chunk.choices]
    assert whole.logprobs.tokens == [f"token_id:{t}" for t in PROMPTS[0]]
    assert "".join(c.text for c in streamed) == whole.text
    assert [t for c in streamed for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert chunks[-1].usage.completion_tokens == 0
    assert chunks[-1].usage.prompt_tokens == len(PROMPTS[0])


def test_usage_reports_the_prompt_tokens_read_from_the_cache(oai, model_id):
    prompt = list(range(300, 340))  # 40 tokens no other test sends: two full 16-token blocks
    fields = {"model": model_id, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    first, second = (oai.completions.create(**fields) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    messages = [{"role": "user", "content": "tell me about the cache " * 4}]
    replies = [oai.chat.completions.create(model=model_id, messages=messages, max_tokens=2,
                                           extra_body={"chat_template": CHAT_TEMPLATE})
               for _ in range(2)]
    full_blocks = (replies[1].usage.prompt_tokens - 1) // 16 * 16  # one is always computed
    assert replies[1].usage.prompt_tokens_details.cached_tokens == full_blocks
    streamed = list(oai.chat.completions.create(
        model=model_id, messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"chat_template": CHAT_TEMPLATE}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == full_blocks
