"""Every front door gives a completion the text `LLM.generate` gives (tests/integration/
test_completion_text.py), on a SentencePiece-style tokenizer: gRPC GenerateBatch and Generate
streams, HTTP completions and chat, streamed and not, with and without stop strings. The text
is decoded after the prompt (the first token keeps its leading space) and leaves a stop
token's text out (vLLM's detokenizer)."""

from __future__ import annotations

import collections

import openai
import pytest

from tests.e2e.http_helpers import CHAT_TEMPLATE
from tests.e2e.server_process import start_server
from tests.metaspace_model import build_metaspace_tokenizer
from trainer_bridge import EngineClient, SamplingParams

PROMPT = "Some of"
MESSAGES = [{"role": "user", "content": PROMPT}]
NEVER = "never in this text"


@pytest.fixture(scope="module")
def model_dir(metaspace_model_dir):
    return metaspace_model_dir


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    process = start_server(tmp_path_factory, model_dir, "--http-port", "0",
                           "--trust-request-chat-template")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def client(served):
    with EngineClient(served.address, timeout=60) as engine_client:
        engine_client.wait_until_ready(30)
        yield engine_client


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as http_client:
        yield http_client


@pytest.fixture(scope="module")
def ids() -> dict[str, int]:
    vocab = build_metaspace_tokenizer().get_vocab()
    return {"the": vocab["\u2581the"], "of": vocab["\u2581of"]}


def cases(ids) -> dict[str, tuple[dict, str]]:
    """Sampling fields and the text they give: forced tokens, and a stop token sampled once
    min_tokens lets it through."""
    forced = {"max_tokens": 4, "temperature": 0.0, "allowed_token_ids": [ids["the"]]}
    stopped = {"max_tokens": 8, "temperature": 0.0, "min_tokens": 2,
               "allowed_token_ids": [ids["the"], ids["of"]], "logit_bias": {ids["of"]: 50.0},
               "stop_token_ids": [ids["of"]]}
    return {"forced": (forced, " the the the the"), "stop token": (stopped, " the the")}


def http_fields(fields: dict) -> dict:
    """The openai client's arguments for these sampling fields."""
    native = {"max_tokens", "temperature", "stop"}
    extra = {k: v for k, v in fields.items() if k not in native and k != "logit_bias"}
    body = {k: v for k, v in fields.items() if k in native}
    if "logit_bias" in fields:
        body["logit_bias"] = {str(k): v for k, v in fields["logit_bias"].items()}
    return {**body, "extra_body": extra}


def joined(chunks, content) -> str:
    pieces: dict[int, list[str]] = collections.defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            pieces[choice.index].append(content(choice) or "")
    (text,) = ["".join(p) for p in pieces.values()]
    return text


def test_every_front_door_gives_the_offline_text(oai, client, ids):
    for name, (fields, expected) in cases(ids).items():
        for stop in ([], [NEVER]):
            fields = {**fields, "stop": stop}
            params = SamplingParams(**fields)
            (batch,) = client.generate([PROMPT], params)
            *_, streamed = client.generate_stream(PROMPT, params)
            texts = {"grpc batch": batch.outputs[0].text, "grpc stream": streamed.outputs[0].text}
            request = {"model": oai.models.list().data[0].id, **http_fields(fields)}
            texts["http"] = oai.completions.create(prompt=PROMPT, **request).choices[0].text
            texts["http stream"] = joined(
                oai.completions.create(prompt=PROMPT, stream=True, **request),
                lambda choice: choice.text)
            request["extra_body"] = {**request["extra_body"], "chat_template": CHAT_TEMPLATE}
            texts["chat"] = oai.chat.completions.create(
                messages=MESSAGES, **request).choices[0].message.content
            texts["chat stream"] = joined(
                oai.chat.completions.create(messages=MESSAGES, stream=True, **request),
                lambda choice: choice.delta.content)
            assert {k: v for k, v in texts.items() if v != expected} == {}, (name, stop)
