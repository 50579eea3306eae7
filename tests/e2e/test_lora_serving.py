"""LoRA adapters through a real server: `serve --enable-lora --lora-modules`, requests naming
an adapter as their HTTP `model` or gRPC `lora_name`, vLLM's load/unload endpoints, adapters
pushed from memory over the weight transports (no disk), and replacing an adapter in place
while a stream still runs on the old one. PEFT's own model is the oracle of every answer."""

from __future__ import annotations

import threading

import openai
import pytest
import requests
import torch
from peft import get_peft_model_state_dict

from rollout_engine import LoRAError, SamplingParams
from tests.e2e.server_process import AUTH_TOKEN, start_server
from tests.integration.hf_oracle import load_hf_model
from tests.lora_adapters import load_peft, make_adapter, peft_greedy
from trainer_bridge import EngineClient

PROMPT = [5, 17, 99, 250, 7]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("served_lora")
    return {"qv": make_adapter(llama_dir, root / "qv", r=4, target_modules=["q_proj", "v_proj"]),
            "all": make_adapter(llama_dir, root / "all", r=8, seed=1),
            "mlp": make_adapter(llama_dir, root / "mlp", r=16, seed=2,
                                target_modules=["gate_proj", "up_proj", "down_proj"])}


@pytest.fixture(scope="module")
def oracles(llama_dir, adapter_dirs):
    models = {name: load_peft(llama_dir, path) for name, path in adapter_dirs.items()}
    models[None] = load_hf_model(str(llama_dir))
    return models


@pytest.fixture(scope="module")
def server(tmp_path_factory, llama_dir, adapter_dirs):
    process = start_server(tmp_path_factory, llama_dir, "--http-port", "0", "--auth-token",
                           AUTH_TOKEN, "--enable-lora", "--max-loras", "2",
                           "--lora-modules", f"qv={adapter_dirs['qv']}")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with EngineClient(server.address, auth_token=AUTH_TOKEN, timeout=60) as engine_client:
        engine_client.wait_until_ready(30)
        yield engine_client


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as http_client:
        yield http_client


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def http_tokens(oai, model: str) -> tuple[str, list[int]]:
    response = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True})
    return response.model, response.choices[0].token_ids


def test_http_model_names_the_adapter(server, oai, oracles, llama_dir):
    cards = {card.id: card for card in oai.models.list().data}
    base = str(llama_dir)
    assert set(cards) == {base, "qv"} and cards["qv"].parent == base
    assert http_tokens(oai, "qv") == ("qv", peft_greedy(oracles["qv"], PROMPT, MAX_TOKENS))
    assert http_tokens(oai, base) == (base, peft_greedy(oracles[None], PROMPT, MAX_TOKENS))
    with pytest.raises(openai.NotFoundError):
        http_tokens(oai, "nope")
    # TRL's AsyncGRPO reads its adapter-only sync capability here.
    info = requests.get(f"{server.http_url}/server_info", params={"config_format": "json"},
                        timeout=30).json()["vllm_config"]
    assert info["lora_config"] == {"max_lora_rank": 16, "max_loras": 2, "max_cpu_loras": 2}


def test_http_load_and_unload(server, oai, oracles, adapter_dirs):
    url = server.http_url
    body = {"lora_name": "all", "lora_path": str(adapter_dirs["all"])}
    answer = requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
    assert answer.status_code == 200 and "added successfully" in answer.text
    again = requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
    assert again.status_code == 400 and "already been loaded" in again.text
    bad = requests.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": "bad", "lora_path": "/nowhere"}, timeout=30)
    assert bad.status_code == 400
    assert http_tokens(oai, "all")[1] == peft_greedy(oracles["all"], PROMPT, MAX_TOKENS)
    gone = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "all"}, timeout=30)
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "all"},
                         timeout=30).status_code == 404
    with pytest.raises(openai.NotFoundError):
        http_tokens(oai, "all")


def test_grpc_lora_name_and_push_from_memory(client, oracles):
    (output,) = client.generate([PROMPT], greedy(), lora_name="qv")
    assert output.outputs[0].token_ids == peft_greedy(oracles["qv"], PROMPT, MAX_TOKENS)
    (qv,) = [a for a in client.list_lora_adapters() if a.lora_name == "qv"]
    assert {span.lora_version for span in output.outputs[0].weight_versions} == {qv.version}
    (output,) = client.generate([PROMPT], greedy())
    assert {span.lora_version for span in output.outputs[0].weight_versions} == {0}
    with pytest.raises(LoRAError, match="no LoRA adapter"):
        client.generate([PROMPT], greedy(), lora_name="nope")
    model = oracles["mlp"]
    for transport in ("stream", "shm"):
        name = f"pushed-{transport}"
        adapter = client.load_lora_adapter(name, get_peft_model_state_dict(model),
                                           model.peft_config["default"], transport=transport)
        assert adapter.lora_name == name and adapter.lora_path == ""
        (output,) = client.generate([PROMPT], greedy(), lora_name=name)
        assert output.outputs[0].token_ids == peft_greedy(model, PROMPT, MAX_TOKENS)
        assert client.unload_lora_adapter(name) is True
    assert [a.lora_name for a in client.list_lora_adapters()] == ["qv"]


def test_in_place_swap_under_a_running_stream(client, oracles):
    """A stream running under version 1 finishes under it while version 2 is loaded in place
    (each completion's weight_versions name its load); a bad version 3 is refused whole and
    version 2 serves on."""
    old, new = oracles["all"], oracles["mlp"]
    v1 = client.load_lora_adapter("policy", get_peft_model_state_dict(old),
                                  old.peft_config["default"])
    long_run = 200
    stream = client.generate_stream(PROMPT, greedy(long_run), lora_name="policy")
    first = next(stream)  # running under version 1
    swapped = []

    def swap() -> None:
        swapped.append(client.load_lora_adapter("policy", get_peft_model_state_dict(new),
                                                new.peft_config["default"], load_inplace=True))

    swapper = threading.Thread(target=swap)
    swapper.start()
    *_, last = [first, *stream]
    swapper.join(30)
    (v2,) = swapped
    assert (v2.lora_int_id, v2.lora_path) == (v1.lora_int_id, "") and v2.version > v1.version > 0
    assert last.outputs[0].token_ids == peft_greedy(old, PROMPT, long_run)
    assert {span.lora_version for span in last.outputs[0].weight_versions} == {v1.version}
    (output,) = client.generate([PROMPT], greedy(), lora_name="policy")
    assert output.outputs[0].token_ids == peft_greedy(new, PROMPT, MAX_TOKENS)
    assert {span.lora_version for span in output.outputs[0].weight_versions} == {v2.version}
    broken = {name: torch.zeros(3, 3) for name in get_peft_model_state_dict(new)}
    with pytest.raises(LoRAError, match="do not fit"):
        client.load_lora_adapter("policy", broken, new.peft_config["default"], load_inplace=True)
    (output,) = client.generate([PROMPT], greedy(), lora_name="policy")
    assert output.outputs[0].token_ids == peft_greedy(new, PROMPT, MAX_TOKENS)
    assert [a.version for a in client.list_lora_adapters() if a.lora_name == "policy"] == [
        v2.version]
    assert client.unload_lora_adapter("policy")
