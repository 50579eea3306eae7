"""A failed step in a real server: the affected calls get a clear status, the server keeps
serving correct tokens, drains and sleeps, accepts updates, leaks no block and never spins."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from rollout_engine.protocol import SERVICE_NAME
from tests.e2e.server_process import start_server, wait_for
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import (
    EngineClient,
    EngineSleepingError,
    InternalError,
    ResourceExhaustedError,
    SamplingParams,
)

MAX_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
PROMPTS = [[5 + i, 17, 99, 250, 7, 31, 64, 128, 3, 77, 200, 11, 13, 400, 8, 9, 21, 44]
           for i in range(3)]
# The injector's error, the status it travels as, and the engine error type the client sees.
FAULTS = {
    "oom": (ResourceExhaustedError, "DeviceOutOfMemoryError", "out of memory"),
    "runtime": (InternalError, "StepFailedError", "InjectedFault"),
    "interrupt": (InternalError, "StepFailedError", "KeyboardInterrupt"),
}
SERVER_FLAGS = ("--block-size", "4", "--max-num-batched-tokens", "16",
                "--num-speculative-tokens", "3")


def start_faulty_server(tmp_path_factory, llama_dir, **fault):
    env = {"ROLLOUT_ENGINE_FAULT_INJECTION": json.dumps(fault)}
    return start_server(tmp_path_factory, llama_dir, *SERVER_FLAGS, env=env)


def assert_idle_and_clean(server, client: EngineClient) -> None:
    info = client.info()
    assert info.num_free_blocks == info.num_blocks, "a KV block leaked"
    assert info.num_inflight_requests == 0 and info.num_unfinished_requests == 0
    before_s = server.cpu_time_s()
    time.sleep(1.0)
    assert server.cpu_time_s() - before_s < 0.3, "the idle engine thread is spinning"


@pytest.fixture(scope="module")
def oracle(llama_dir):
    return hf_greedy_batch(str(llama_dir), PROMPTS, MAX_NEW_TOKENS)


@pytest.mark.parametrize("error", [  # interrupt travels as runtime does: a server of its own
    "oom", "runtime", pytest.param("interrupt", marks=pytest.mark.slow)])
def test_failed_step_gives_a_status_and_the_server_goes_on(tmp_path_factory, llama_dir, oracle,
                                                           error):
    server = start_faulty_server(tmp_path_factory, llama_dir, when="chunked_prefill", error=error)
    status, error_type, words = FAULTS[error]
    try:
        with EngineClient(server.address, timeout=60) as client:
            client.wait_until_ready(30)
            with pytest.raises(status, match=words) as failure:
                client.generate(PROMPTS, GREEDY)
            assert failure.value.error_type == error_type
            assert [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)] == oracle
            assert_idle_and_clean(server, client)
            assert client.sleep(level=1, mode="wait") == 0
            client.wake_up()
            assert client.update_weights(load_file(str(llama_dir / "model.safetensors"))) == 1
            assert [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)] == oracle
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_a_step_failing_during_a_draining_sleep(tmp_path_factory, llama_dir, oracle):
    """Sleep(mode="wait") drains; a step that fails meanwhile ends its call with a status and
    the sleep still completes (it used to leave the engine thread spinning forever)."""
    trigger = tmp_path_factory.mktemp("fault") / "fire"
    server = start_faulty_server(
        tmp_path_factory, llama_dir, when="decode", error="oom", trigger_file=str(trigger)
    )
    long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    results: dict[str, object] = {}
    try:
        with EngineClient(server.address, timeout=60) as client:
            client.wait_until_ready(30)

            def generate() -> None:
                try:
                    results["generate"] = client.generate(PROMPTS[:1], long_run)
                except Exception as exc:  # noqa: BLE001 - inspected below
                    results["generate"] = exc

            def sleep() -> None:
                results["sleep"] = client.sleep(level=1, mode="wait")

            threads = [threading.Thread(target=generate)]
            threads[0].start()
            assert wait_for(lambda: client.info().num_unfinished_requests == 1)
            threads.append(threading.Thread(target=sleep))
            threads[1].start()

            def is_draining() -> bool:  # new prompts are refused once the drain has begun
                try:
                    client.generate(PROMPTS[:1], GREEDY)
                except EngineSleepingError as exc:
                    return "draining" in str(exc)
                return False

            assert wait_for(is_draining, timeout_s=20)
            trigger.touch()
            for thread in threads:
                thread.join(60)
            assert isinstance(results["generate"], ResourceExhaustedError), results
            assert results["sleep"] >= 1  # the long call, and a probe that came before the drain
            client.wake_up()
            trigger.unlink()
            assert [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)] == oracle
            assert_idle_and_clean(server, client)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def test_health_is_not_serving_while_a_step_hangs_then_serving_again(tmp_path_factory, llama_dir,
                                                                     oracle):
    fault = {"when": "prefill", "error": "hang", "hang_s": 3.0}
    server = start_server(tmp_path_factory, llama_dir, "--engine-stall-s", "0.5",
                          env={"ROLLOUT_ENGINE_FAULT_INJECTION": json.dumps(fault)})
    results: dict[str, object] = {}
    try:
        with EngineClient(server.address, timeout=60) as client, \
                grpc.insecure_channel(server.address) as channel:
            client.wait_until_ready(30)
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                request = health_pb2.HealthCheckRequest(service=service)
                return health.Check(request, timeout=5).status

            thread = threading.Thread(
                target=lambda: results.update(out=client.generate(PROMPTS, GREEDY)))
            thread.start()
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert wait_for(lambda: status(SERVICE_NAME) == not_serving, timeout_s=10)
            assert status("") == not_serving
            thread.join(30)
            assert [o.outputs[0].token_ids for o in results["out"]] == oracle
            serving = health_pb2.HealthCheckResponse.SERVING
            assert wait_for(lambda: status(SERVICE_NAME) == serving and status("") == serving)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
