"""Prefill–decode disaggregation between real server processes, through DisaggregatedClient.

A prefill server (`--kv-role prefill`) and a decode server (`--kv-role decode`); the KV moves
over gRPC (PullKV) or /dev/shm. The oracle is Hugging Face's greedy tokens. Failures are real:
a prefill server killed while the decode server pulls from it, a transfer slower than its
timeout, a prefill server that is gone before the prompt reaches it.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from tests.e2e.server_process import start_server
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import (
    DisaggregatedClient,
    EngineClient,
    KVTransferError,
    KVTransferParams,
    SamplingParams,
)

MAX_TOKENS = 8
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randint(20, 60))] for _ in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(llama_dir):
    return hf_greedy_batch(str(llama_dir), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def decode_server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, "--kv-role", "decode")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def grpc_prefill_server(tmp_path_factory, llama_dir):
    process = start_server(
        tmp_path_factory, llama_dir, "--kv-role", "prefill", "--kv-transport", "grpc"
    )
    yield process
    assert process.stop() == 0, process.log()[-3000:]


def engine_stats(address: str) -> dict[str, float]:
    with EngineClient(address, timeout=30) as client:
        return client.info().engine_stats


@pytest.mark.parametrize("transport", [  # shm is also in tests/integration/test_kv_transfer.py
    "grpc", pytest.param("shm", marks=pytest.mark.slow)])
def test_routed_generation_equals_transformers(
    tmp_path_factory, llama_dir, decode_server, grpc_prefill_server, expected, transport
):
    prefill_server = grpc_prefill_server
    if transport == "shm":
        prefill_server = start_server(tmp_path_factory, llama_dir, "--kv-role", "prefill")
    before = engine_stats(decode_server.address)
    try:
        with DisaggregatedClient(prefill_server.address, decode_server.address,
                                 timeout=60) as router:
            router.decode.reset_prefix_cache()  # an earlier run's prompts are cached there
            outputs = router.generate(PROMPTS, GREEDY)
            assert router.num_prefill_failures == 0
    finally:
        if transport == "shm":
            assert prefill_server.stop() == 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    after = engine_stats(decode_server.address)
    loaded = after["kv_loaded_tokens"] - before["kv_loaded_tokens"]
    assert loaded == sum(len(p) - 1 for p in PROMPTS)  # the decode server computed no prompt
    assert after["kv_load_failures"] == before["kv_load_failures"]


def test_a_handle_is_pulled_once_and_a_missing_one_is_not_found(grpc_prefill_server):
    import grpc

    from protos import rollout_pb2 as pb
    from protos import rollout_pb2_grpc as pb_grpc

    with EngineClient(grpc_prefill_server.address, timeout=30) as prefill:
        (output,) = prefill.generate([PROMPTS[0]], SamplingParams(
            max_tokens=1, kv_transfer_params=KVTransferParams(do_remote_decode=True)))
    handle = output.outputs[0].kv_transfer_params
    assert handle.transport == "grpc" and handle.location == grpc_prefill_server.address
    channel = grpc.insecure_channel(grpc_prefill_server.address)
    stub = pb_grpc.RolloutEngineStub(channel)
    messages = list(stub.PullKV(pb.PullKVRequest(transfer_id=handle.transfer_id), timeout=30))
    # Flat: per layer its keys, then its values, [num_tokens, Hkv, D] each.
    assert list(messages[0].shape) == [2 * 2 * (len(PROMPTS[0]) - 1) * 2 * 16]
    assert sum(len(m.data) for m in messages) == 2 * 2 * (len(PROMPTS[0]) - 1) * 2 * 16 * 4
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.PullKV(pb.PullKVRequest(transfer_id=handle.transfer_id), timeout=30))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    channel.close()


@pytest.fixture(scope="module")
def slow_prefill_server(tmp_path_factory, llama_dir):
    """Sends each KV chunk 3 s late: transfers from it are slow enough to kill it mid-way."""
    process = start_server(
        tmp_path_factory, llama_dir, "--kv-role", "prefill", "--kv-transport", "grpc",
        env={"ROLLOUT_ENGINE_KV_SEND_DELAY_S": "3"},
    )
    yield process
    process.stop()


def handles_from(address: str) -> list[KVTransferParams]:
    params = SamplingParams(max_tokens=1, kv_transfer_params=KVTransferParams(
        do_remote_decode=True))
    with EngineClient(address, timeout=60) as prefill:
        return [o.outputs[0].kv_transfer_params for o in prefill.generate(PROMPTS, params)]


def test_a_transfer_past_its_timeout_is_recomputed(
    tmp_path_factory, llama_dir, slow_prefill_server, expected
):
    decode_server = start_server(
        tmp_path_factory, llama_dir, "--kv-role", "decode", "--kv-transfer-timeout-s", "1"
    )
    try:
        handles = handles_from(slow_prefill_server.address)
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 kv_transfer_params=h) for h in handles]
        started = time.monotonic()
        with EngineClient(decode_server.address, timeout=60) as decode:
            outputs = decode.generate(PROMPTS, params)
        assert time.monotonic() - started < 3  # it did not wait for the slow peer
        assert [o.outputs[0].token_ids for o in outputs] == expected
        stats = engine_stats(decode_server.address)
        assert stats["kv_load_failures"] == len(PROMPTS) and stats["kv_loaded_tokens"] == 0
    finally:
        assert decode_server.stop() == 0


def test_killing_the_prefill_server_mid_transfer_recomputes_and_the_router_falls_back(
    slow_prefill_server, decode_server, expected
):
    handles = handles_from(slow_prefill_server.address)
    with EngineClient(decode_server.address, timeout=30) as client:
        client.reset_prefix_cache()
    before = engine_stats(decode_server.address)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             kv_transfer_params=h) for h in handles]
    results = {}

    def decode() -> None:
        with EngineClient(decode_server.address, timeout=60) as client:
            results["outputs"] = client.generate(PROMPTS, params)

    thread = threading.Thread(target=decode)
    thread.start()
    time.sleep(1.0)  # the decode server is pulling: headers received, data 3 s away
    assert "outputs" not in results
    slow_prefill_server.process.send_signal(signal.SIGKILL)
    thread.join(30)
    assert [o.outputs[0].token_ids for o in results["outputs"]] == expected
    after = engine_stats(decode_server.address)
    assert after["kv_load_failures"] - before["kv_load_failures"] == len(PROMPTS)

    # The prefill server is gone: the router sends the prompts to decode without a handle.
    with DisaggregatedClient(slow_prefill_server.address, decode_server.address, timeout=30,
                             max_retries=0) as router:
        outputs = router.generate(PROMPTS, GREEDY)
        assert router.num_prefill_failures == len(PROMPTS)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_weights_pushed_through_the_router_keep_versions_equal_and_a_mismatch_is_refused(
    llama_dir, decode_server, grpc_prefill_server, expected
):
    from rollout_engine.worker.weights.loader import iterate_checkpoint

    weights = list(iterate_checkpoint(str(llama_dir)))
    with DisaggregatedClient(grpc_prefill_server.address, decode_server.address,
                             timeout=60) as router:
        version = router.update_weights(weights)
        assert version >= 1
        outputs = router.generate(PROMPTS[:2], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected[:2]
        router.decode.update_weights(weights)  # only one side: the versions now differ
        with pytest.raises(KVTransferError, match="weight version"):
            router.generate(PROMPTS[:1], GREEDY)
        router.prefill.update_weights(weights)  # equal again
        outputs = router.generate(PROMPTS[:1], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected[:1]
