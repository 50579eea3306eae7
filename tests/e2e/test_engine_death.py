"""An engine server killed (SIGKILL) in the middle of a call: the client raises UNAVAILABLE
within its deadline and never hangs, and the colocation loop resumes on a restarted server
with a full weight push."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.e2e.server_process import ENGINE_OPTIONS
from tests.integration.hf_oracle import hf_greedy
from trainer_bridge import EngineClient, SamplingParams, UnavailableError
from trainer_bridge.colocate import Colocation
from trainer_bridge.server_process import EngineServer

DEADLINE_S = 30.0
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture()
def engine(llama_dir, tmp_path):
    server = EngineServer(llama_dir, engine_options=ENGINE_OPTIONS,
                          log_path=tmp_path / "engine.log")
    yield server
    server.kill()


def kill_during(server: EngineServer, call) -> tuple[BaseException | None, float]:
    """Freeze the server, start `call` (so it is in flight), then SIGKILL the server; the
    call's exception and how long it took to come back."""
    os.kill(server.pid, signal.SIGSTOP)
    outcome: dict[str, object] = {}

    def run() -> None:
        start_s = time.monotonic()
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            outcome["error"] = exc
        outcome["duration_s"] = time.monotonic() - start_s

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), "the call returned from a frozen server"
    server.kill()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the call hangs after the server died"
    return outcome.get("error"), outcome["duration_s"]


@pytest.mark.parametrize("verb", [  # a server each: two of the four in the fast suite
    pytest.param("generate", marks=pytest.mark.slow), "update_weights",
    pytest.param("sleep", marks=pytest.mark.slow), "generate_stream"])
def test_a_call_to_a_server_killed_mid_call_is_unavailable(engine, llama_dir, verb):
    client = EngineClient(engine.address, timeout=DEADLINE_S)
    client.wait_until_ready(30)
    weights = {"model.norm.weight": torch.ones(64)}
    calls = {
        "generate": lambda: client.generate([[5, 6, 7]], LONG),
        "update_weights": lambda: client.update_weights(weights, transport="stream"),
        "sleep": lambda: client.sleep(level=2, mode="wait"),
        "generate_stream": lambda: list(client.generate_stream([5, 6, 7], LONG)),
    }
    error, duration_s = kill_during(engine, calls[verb])
    assert isinstance(error, UnavailableError), repr(error)
    assert duration_s < 15, duration_s  # retried sleep included
    client.close()


def test_colocation_resumes_on_a_restarted_server_with_a_full_push(engine, llama_dir):
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # the trainer's policy differs from the checkpoint
    prompt = [5, 17, 99, 250, 7, 31]
    expected = hf_greedy_model(model, prompt, 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    client = EngineClient(engine.address, timeout=DEADLINE_S)
    colocation = Colocation(client, sleep_level=2)
    with colocation.rollout(weights=model) as rollout_client:
        assert rollout_client.generate([prompt], greedy)[0].outputs[0].token_ids == expected
    engine.kill()
    with pytest.raises(UnavailableError), colocation.rollout(weights=model) as rollout_client:
        rollout_client.generate([prompt], greedy)
    client.close()
    engine.restart()
    restarted = EngineClient(engine.address, timeout=DEADLINE_S)
    restarted.wait_until_ready(30)
    colocation.attach(restarted)
    assert colocation.needs_weights
    with colocation.rollout(weights=model) as rollout_client:
        assert rollout_client.generate([prompt], greedy)[0].outputs[0].token_ids == expected
    assert restarted.info().weight_version == 1  # the trainer's weights, pushed in full
    restarted.close()


def hf_greedy_model(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of an in-memory transformers model (EOS ignored)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_hf_greedy_helpers_agree(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    assert hf_greedy_model(model, [5, 6, 7], 5) == hf_greedy(str(llama_dir), [5, 6, 7], 5)
