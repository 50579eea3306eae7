"""TRL's AsyncGRPOTrainer against `serve --http-port`: TRL's own rollout worker generates over
the HTTP API while the trainer trains, and `EngineWeightTransfer` syncs the weights over gRPC
with the requests in flight kept across each pause.

A recording proxy between the worker and the server timestamps every `/v1/completions`
exchange, and the trainer's rollout queue is tapped, so the test sees what the engine sent
and what the trainer trained on. Two CPU stand-ins: the trainer's tree attention (an FA3
kernel) runs as SDPA per segment, and its MFU lookup (which asks CUDA for the device name)
is off. The HTTP completions carry no per-token weight versions, so a kept request is seen
by its times (sent before a pause, answered after the resume), not by its spans."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from datasets import Dataset
from trl.experimental.async_grpo import AsyncGRPOConfig

from tests.e2e.server_process import start_server
from tests.e2e.trl_async_helpers import TappedQueue, worker_tokenizer
from trainer_bridge import EngineClient
from trainer_bridge.trl_async import EngineAsyncGRPOTrainer, EngineWeightTransfer

NUM_STEPS = 3
PROMPTS = ["the sun is hot", "a dog ran home", "we can read a book", "my friend has a car"]


def completion_length_reward(completions: list, **kwargs) -> list[float]:
    """Module level: the worker's child process unpickles it by name."""
    return [float(len(messages[-1]["content"])) for messages in completions]


@dataclass(frozen=True)
class Exchange:
    """One `/v1/completions` call as the proxy saw it."""

    request: dict
    status: int
    response: dict
    sent_s: float
    answered_s: float


class RecordingProxy:
    """Forwards HTTP to the server, recording each `/v1/completions` exchange and its times."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream = urllib.parse.urlsplit(upstream_url).netloc
        self.exchanges: list[Exchange] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the worker's aiohttp session expects

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def _forward(self, body: bytes | None) -> None:
                sent_s = time.monotonic()
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=120)
                upstream.request(self.command, self.path, body=body,
                                 headers={"Content-Type": "application/json"})
                reply = upstream.getresponse()
                data = reply.read()
                upstream.close()
                if self.path.startswith("/v1/completions"):
                    proxy.exchanges.append(Exchange(json.loads(body), reply.status,
                                                    json.loads(data), sent_s, time.monotonic()))
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.getheader("Content-Type", "text/plain"))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        return Handler


class StampedTransfer(EngineWeightTransfer):
    """EngineWeightTransfer that notes when each pause and resume happened: a pause once it has
    taken effect (a request sent while the pause call was on its way is kept too), a resume
    once it has."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.paused_s: list[float] = []
        self.resumed_s: list[float] = []

    def pause(self) -> None:
        super().pause()
        self.paused_s.append(time.monotonic())

    def resume(self) -> None:
        super().resume()
        self.resumed_s.append(time.monotonic())


@pytest.fixture(scope="module")
def async_server(tmp_path_factory, llama_dir):
    """A server of its own: the test changes its weights."""
    process = start_server(tmp_path_factory, llama_dir, "--http-port", "0")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


def test_async_grpo_trains_with_kept_requests(async_server, llama_dir, tmp_path,
                                              cpu_trainer_kernels):
    proxy = RecordingProxy(async_server.http_url)
    tokenizer = worker_tokenizer(llama_dir)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=NUM_STEPS, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=16, token_budget=0, max_inflight_tasks=8,
        learning_rate=1e-3, vllm_server_base_url=proxy.url, report_to="none",
        save_strategy="no", logging_steps=1, bf16=False, gradient_checkpointing=False,
    )
    transfer = StampedTransfer(async_server.address)
    trainer = EngineAsyncGRPOTrainer(
        model=str(llama_dir), reward_funcs=completion_length_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}]
                                                    for p in PROMPTS]}),
        processing_class=tokenizer, weight_transfer=transfer,
    )
    cpu_trainer_kernels()
    trainer.rollout_queue = tapped = TappedQueue(trainer.rollout_queue)
    trainer.rollout_worker.stop = tapped.drain_while(trainer.rollout_worker.stop)
    try:
        trainer.train()
    finally:
        proxy.close()

    # A cold sync before the first rollout, then one after every step.
    versions = [sync.weight_version for sync in transfer.syncs]
    assert versions == list(range(versions[0], versions[0] + NUM_STEPS + 1)), versions
    with EngineClient(async_server.address) as client:
        assert client.info().weight_version == versions[-1]

    # Requests sent during a pause, the weight update included, queue for the resume (as
    # vLLM's pause has them): none is refused.
    assert all(e.status == 200 for e in proxy.exchanges), [
        (e.status, e.response) for e in proxy.exchanges if e.status != 200]
    answered = proxy.exchanges

    # The trainer's old logprobs are the engine's sampling logprobs, token for token.
    sampled = {}
    for exchange in answered:
        choice = exchange.response["choices"][0]
        key = tuple(exchange.request["prompt"] + choice["token_ids"])
        sampled.setdefault(key, []).append(choice["logprobs"]["token_logprobs"])
    assert len(tapped.samples) >= NUM_STEPS * args.per_device_train_batch_size
    for sample in tapped.samples:
        trained = sample.completion_mask.astype(bool)
        engine_logprobs = sampled[tuple(sample.input_ids.tolist())]
        assert any(np.array_equal(sample.old_log_probs[trained], np.asarray(lps, np.float32))
                   for lps in engine_logprobs)
    # The first step's completions were all sampled by the weights of the cold sync, which
    # are the trainer's: it scores them as the engine did.
    first_step = trainer.state.log_history[0]
    assert first_step["sample/staleness_max"] == 0 and first_step["kl"] < 1e-6, first_step

    # Syncs after the worker started found requests in flight and kept them: each was
    # answered in full after the resume, none aborted.
    assert all(e.response["choices"][0]["finish_reason"] in ("stop", "length") for e in answered)
    kept = [e for sync, paused_s, resumed_s in zip(transfer.syncs, transfer.paused_s,
                                                    transfer.resumed_s)
            if sync.num_kept_requests > 0
            for e in answered if e.sent_s < paused_s and e.answered_s > resumed_s]
    assert kept, [sync.num_kept_requests for sync in transfer.syncs]


def test_a_lora_policy_needs_an_engine_serving_lora(async_server, llama_dir, tmp_path,
                                                    cpu_trainer_kernels):
    """TRL's own fallback (merged weights over NCCL) is not this engine's: a clear refusal,
    with the fix, before anything starts."""
    from peft import LoraConfig

    tokenizer = worker_tokenizer(llama_dir)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none",
                           vllm_server_base_url=async_server.http_url, bf16=False)
    with pytest.raises(ValueError, match="--enable-lora, or pass lora_sync='merged'"):
        EngineAsyncGRPOTrainer(
            model=str(llama_dir), reward_funcs=completion_length_reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]}),
            processing_class=tokenizer, peft_config=LoraConfig(r=4, target_modules="all-linear"),
            engine=async_server.address)
