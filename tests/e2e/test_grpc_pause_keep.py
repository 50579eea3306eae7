"""Generation that survives a weight update, through a real server: a stream held across a
pause in "keep" mode and a weight update completes with the old policy's tokens, then the new
one's; a batch kept across a level-2 sleep does the same. And the pause state over gRPC and
HTTP: a "wait" pause reads as paused while it drains, and a resume meanwhile cancels it."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from safetensors.torch import load_file

from tests.e2e.server_process import start_server, wait_for
from tests.integration.hf_oracle import hf_greedy
from trainer_bridge import EngineClient, SamplingParams

PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90]]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, "--http-port", "0")
    yield process
    process.stop()


@pytest.fixture
def client(server, llama_dir):
    with EngineClient(server.address, timeout=60) as engine_client:
        engine_client.wait_until_ready(30)
        yield engine_client
        # Awake, with the checkpoint's weights and no pause, for the next test.
        engine_client.resume_generation()
        engine_client.wake_up()
        engine_client.update_weights(load_file(str(llama_dir / "model.safetensors")))


def check_switch(completion, prompt, old_dir, new_dir, old_version: int) -> None:
    """Two spans of weight versions; the old policy's greedy tokens up to the switch, the new
    policy's from the same prefix after it."""
    first, second = completion.weight_versions
    assert (first.version, first.start) == (old_version, 0)
    assert (second.version, second.end) == (old_version + 1, MAX_TOKENS)
    switch = first.end
    assert switch == second.start and 0 < switch < MAX_TOKENS
    tokens = completion.token_ids
    assert tokens[:switch] == hf_greedy(str(old_dir), prompt, switch)
    assert tokens[switch:] == hf_greedy(str(new_dir), prompt + tokens[:switch],
                                        MAX_TOKENS - switch)


def start_streams(client, prompts) -> tuple[list[list], list[threading.Thread]]:
    """One Generate stream per prompt on its own thread, and their snapshots as they come;
    returns once each has streamed a few tokens."""
    snapshots: list[list] = [[] for _ in prompts]
    threads = []
    for prompt, received in zip(prompts, snapshots):
        thread = threading.Thread(target=lambda p=prompt, r=received: r.extend(
            client.generate_stream(p, GREEDY, timeout=60)))
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + 30
    while not all(r and len(r[-1].outputs[0].token_ids) >= 3 for r in snapshots):
        assert time.monotonic() < deadline, "no tokens streamed"
        time.sleep(0.005)
    return snapshots, threads


def start_long_stream(client, max_tokens: int, results: dict, key: str, n: int = 1
                      ) -> threading.Thread:
    """A greedy stream of PROMPTS[0] (`n` samples) on a thread, its snapshots put in
    `results[key]` when it ends; returns once the engine has it in flight."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    reader = threading.Thread(target=lambda: results.update(
        {key: list(client.generate_stream(PROMPTS[0], params, timeout=120))}))
    reader.start()
    while not client.info().num_unfinished_requests:
        time.sleep(0.002)
    return reader


def test_a_stream_held_across_a_pause_and_an_update_completes(client, llama_dir,
                                                               other_model_dirs):
    new_dir = other_model_dirs[1]
    old_version = client.info().weight_version
    (snapshots,), (reader,) = start_streams(client, PROMPTS[:1])
    assert client.pause_generation("keep") == 1 and client.is_paused()
    time.sleep(0.3)  # the outputs of steps before the pause may still be on the wire
    num_tokens = len(snapshots[-1].outputs[0].token_ids)
    time.sleep(0.3)  # paused: the stream waits, nothing is generated
    assert len(snapshots[-1].outputs[0].token_ids) == num_tokens and reader.is_alive()
    client.update_weights(load_file(str(new_dir / "model.safetensors")))
    client.resume_generation()
    reader.join(60)
    final = snapshots[-1].outputs[0]
    assert final.finish_reason == "length" and not client.is_paused()
    check_switch(final, PROMPTS[0], llama_dir, new_dir, old_version)


def test_streams_kept_across_a_level_2_sleep_go_on_with_the_new_weights(
    client, llama_dir, other_model_dirs
):
    new_dir = other_model_dirs[2]
    old_version = client.info().weight_version
    snapshots, streams = start_streams(client, PROMPTS)
    assert client.sleep(level=2, mode="keep") == len(PROMPTS)
    assert client.memory_state().is_sleeping and all(s.is_alive() for s in streams)
    client.wake_up(["weights"])
    client.update_weights(load_file(str(new_dir / "model.safetensors")))
    client.wake_up(["kv_cache"])  # awake with valid weights: the kept requests go on
    for stream in streams:
        stream.join(60)
    for received, prompt in zip(snapshots, PROMPTS):
        check_switch(received[-1].outputs[0], prompt, llama_dir, new_dir, old_version)
    assert client.info().num_free_blocks == client.info().num_blocks


def test_a_request_sent_during_a_wait_pause_runs_after_the_resume(client, llama_dir):
    """PauseGeneration("wait") drains what is in flight; a Generate sent meanwhile is neither
    refused nor scheduled (the drain would never end): it queues, and runs after the resume
    (vLLM's pause queues it the same way). One cancelled by its caller while held never runs."""
    results: dict[str, object] = {}
    # Long enough to drain for a while on a fast machine (the tiny model steps in well under
    # a millisecond, and the server's max_model_len is 256): sixteen samples.
    reader = start_long_stream(client, 240, results, "drained_stream", n=16)
    pause = threading.Thread(target=lambda: results.update(
        drained=client.pause_generation("wait")))
    pause.start()
    time.sleep(0.05)
    late = threading.Thread(target=lambda: results.update(
        late=client.generate([PROMPTS[1]], GREEDY, timeout=120)[0]))
    late.start()
    with pytest.raises(Exception, match="(?i)deadline"):  # its caller gives up while held
        client.generate([PROMPTS[1]], GREEDY, timeout=0.1)
    assert reader.is_alive() and pause.is_alive()  # both were sent during the drain
    pause.join(120)
    reader.join(120)
    assert results["drained"] == 1  # one prompt
    assert {o.finish_reason for o in results["drained_stream"][-1].outputs} == {"length"}
    time.sleep(0.2)
    assert client.is_paused() and "late" not in results  # queued, not run
    assert client.info().num_unfinished_requests == 1  # the cancelled one was never added
    client.resume_generation()
    late.join(60)
    assert results["late"].outputs[0].token_ids == hf_greedy(str(llama_dir), PROMPTS[1],
                                                             MAX_TOKENS)
    assert client.info().num_unfinished_requests == 0
    assert client.info().num_free_blocks == client.info().num_blocks


@pytest.mark.parametrize("verb", ["pause", "sleep"])
def test_a_wait_whose_caller_gave_up_is_dropped_and_the_engine_serves(client, server, llama_dir,
                                                                      verb):
    """PauseGeneration or Sleep with mode "wait" whose caller goes away (deadline) while it
    drains: nothing is paused or put to sleep when the drain ends, and the engine serves."""
    results: dict[str, object] = {}
    reader = start_long_stream(client, 300, results, "stream")
    with (EngineClient(server.address, timeout=0.2) as hasty,
          pytest.raises(Exception, match="(?i)deadline")):
        if verb == "pause":
            hasty.pause_generation("wait")
        else:
            hasty.sleep(level=1, mode="wait")
    assert reader.is_alive()  # it gave up during the drain
    reader.join(120)
    assert results["stream"][-1].outputs[0].finish_reason == "length"
    assert not client.is_paused() and not client.memory_state().is_sleeping
    (output,) = client.generate([PROMPTS[1]], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(str(llama_dir), PROMPTS[1], MAX_TOKENS)


class PauseControl:
    """PauseGeneration, ResumeGeneration and IsPaused of one transport: gRPC (EngineClient) or
    HTTP (vLLM's `/pause`, `/resume`, `/is_paused`)."""

    def __init__(self, server, transport: str) -> None:
        self.server, self.transport = server, transport

    def pause_wait(self) -> object:
        """The gRPC count of drained requests, or the HTTP answer's JSON."""
        if self.transport == "grpc":
            with EngineClient(self.server.address, timeout=120) as client:
                return client.pause_generation("wait")
        return self._post("/pause?mode=wait").json()

    def resume(self) -> None:
        if self.transport == "grpc":
            with EngineClient(self.server.address, timeout=30) as client:
                client.resume_generation()
        else:
            assert self._post("/resume").json() == {"status": "resumed"}

    def is_paused(self) -> bool:
        if self.transport == "grpc":
            with EngineClient(self.server.address, timeout=30) as client:
                return client.is_paused()
        response = requests.get(self.server.http_url + "/is_paused", timeout=30)
        return response.json()["is_paused"]

    def _post(self, path: str) -> requests.Response:
        response = requests.post(self.server.http_url + path, timeout=120)
        assert response.status_code == 200, response.text
        return response


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_resume_during_a_wait_pause_cancels_it(client, server, llama_dir, transport):
    """The bug: a resume from another client while a "wait" pause drained answered, then the
    drain's end paused the engine anyway and every later request waited forever. As in vLLM,
    the pause reads as paused from its start, the resume leaves the engine running, and the
    pausing call returns once its requests are drained (HTTP says it was resumed). Requests
    sent during the drain and after the resume get the model's greedy tokens."""
    control = PauseControl(server, transport)
    results: dict[str, object] = {}
    reader = start_long_stream(client, 400, results, "drained_stream")
    pause = threading.Thread(target=lambda: results.update(paused=control.pause_wait()))
    pause.start()
    assert wait_for(control.is_paused, timeout_s=10)  # draining: paused to every client
    late = threading.Thread(target=lambda: results.update(
        late=client.generate([PROMPTS[1]], GREEDY, timeout=120)[0]))
    late.start()
    time.sleep(0.05)
    assert pause.is_alive() and reader.is_alive() and "late" not in results  # still draining
    control.resume()
    assert not control.is_paused()
    late.join(60)
    assert results["late"].outputs[0].token_ids == hf_greedy(str(llama_dir), PROMPTS[1],
                                                             MAX_TOKENS)
    pause.join(120)
    reader.join(120)
    assert results["drained_stream"][-1].outputs[0].finish_reason == "length"
    assert results["paused"] == (1 if transport == "grpc" else {"status": "resumed"})
    assert not control.is_paused()  # the drain's end did not pause
    (output,) = client.generate([PROMPTS[1]], GREEDY, timeout=60)
    assert output.outputs[0].token_ids == hf_greedy(str(llama_dir), PROMPTS[1], MAX_TOKENS)
    assert client.info().num_free_blocks == client.info().num_blocks
