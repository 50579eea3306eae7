"""Prefill–decode disaggregation on a GPU: KV saved from CUDA blocks and loaded into CUDA
blocks, host-staged (shm) in one process and by CUDA IPC between two server processes; greedy
tokens equal the Hugging Face model's (fp32)."""

from __future__ import annotations

import pytest

from rollout_engine import LLM
from tests.e2e.server_process import start_server
from tests.integration.hf_oracle import hf_greedy_batch
from tests.integration.test_kv_transfer import MAX_TOKENS, PROMPTS, decode, greedy, prefill
from trainer_bridge import DisaggregatedClient, EngineClient

pytestmark = pytest.mark.gpu


def test_shm_transfer_between_cuda_engines(llama_dir):
    expected = hf_greedy_batch(str(llama_dir), PROMPTS, MAX_TOKENS)
    prefill_llm = LLM(str(llama_dir), device="cuda", dtype="float32", block_size=16,
                      kv_role="prefill")
    decode_llm = LLM(str(llama_dir), device="cuda", dtype="float32", block_size=16,
                     kv_role="decode", async_scheduling=True)
    try:
        handles = prefill(prefill_llm, PROMPTS)
        assert decode(decode_llm, PROMPTS, handles) == expected
        assert decode_llm.stats()["kv_loaded_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    finally:
        prefill_llm.engine.shutdown()
        decode_llm.engine.shutdown()


def test_cuda_ipc_transfer_between_server_processes(tmp_path_factory, llama_dir):
    expected = hf_greedy_batch(str(llama_dir), PROMPTS, MAX_TOKENS)
    cuda = ("--device", "cuda", "--dtype", "float32")
    prefill_server = start_server(tmp_path_factory, llama_dir, *cuda, "--kv-role", "prefill",
                                  "--kv-transport", "cuda_ipc")
    decode_server = start_server(tmp_path_factory, llama_dir, *cuda, "--kv-role", "decode")
    try:
        with DisaggregatedClient(prefill_server.address, decode_server.address,
                                 timeout=120) as router:
            outputs = router.generate(PROMPTS, greedy())
            assert router.num_prefill_failures == 0
        assert [o.outputs[0].token_ids for o in outputs] == expected
        with EngineClient(decode_server.address, timeout=30) as client:
            stats = client.info().engine_stats
        assert stats["kv_load_failures"] == 0
        assert stats["kv_loaded_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    finally:
        assert prefill_server.stop() == 0, prefill_server.log()[-3000:]
        assert decode_server.stop() == 0, decode_server.log()[-3000:]
