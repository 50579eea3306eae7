"""`serve --async-scheduling` in a real server: the same tokens as the synchronous engine, a
failed step ends its calls cleanly, a cancelled stream frees its blocks, and sleep, wake and
weight updates wait for the step in flight."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.e2e.server_process import start_server, wait_for
from tests.e2e.test_grpc_faults import GREEDY, PROMPTS, assert_idle_and_clean
from tests.integration.hf_oracle import hf_greedy_batch
from trainer_bridge import EngineClient, InternalError, SamplingParams

SAMPLED = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=12, seed=21)


def test_served_async_scheduling(tmp_path_factory, llama_dir):
    from rollout_engine import LLM
    from rollout_engine import SamplingParams as EngineSamplingParams

    oracle = hf_greedy_batch(str(llama_dir), PROMPTS, GREEDY.max_tokens)
    reference = LLM(str(llama_dir), block_size=4).generate(
        PROMPTS, EngineSamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=12, seed=21)
    )
    fault = {"when": "decode", "error": "runtime", "skip": 2, "times": 1}
    server = start_server(
        tmp_path_factory, llama_dir, "--async-scheduling", "--block-size", "4",
        env={"ROLLOUT_ENGINE_FAULT_INJECTION": json.dumps(fault)},
    )
    try:
        with EngineClient(server.address, timeout=60) as client:
            client.wait_until_ready(30)
            with pytest.raises(InternalError, match="InjectedFault"):
                client.generate(PROMPTS, GREEDY)
            assert [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)] == oracle
            sampled = client.generate(PROMPTS, SAMPLED)
            assert [[c.token_ids for c in o.outputs] for o in sampled] == [
                [c.token_ids for c in o.outputs] for o in reference
            ]
            stream = client.generate_stream(PROMPTS[0], SamplingParams(max_tokens=200,
                                                                       ignore_eos=True))
            next(iter(stream))
            stream.close()  # cancelled while steps are in flight: the abort comes soon after
            assert wait_for(lambda: client.info().num_unfinished_requests == 0)
            assert_idle_and_clean(server, client)
            assert client.sleep(level=2, mode="wait") == 0
            client.wake_up(["weights"])
            assert client.update_weights(load_file(str(llama_dir / "model.safetensors"))) == 1
            client.wake_up(["kv_cache"])
            assert [o.outputs[0].token_ids for o in client.generate(PROMPTS, GREEDY)] == oracle
            assert_idle_and_clean(server, client)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
