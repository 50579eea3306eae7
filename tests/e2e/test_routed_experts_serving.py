"""Routed experts over gRPC: `serve --enable-return-routed-experts` on a Qwen3-MoE returns the
in-process engine's experts, compactly, from GenerateBatch and from a Generate stream."""

from __future__ import annotations

import numpy as np

from rollout_engine import LLM
from tests.e2e.server_process import start_server
from tests.integration.test_routed_experts import PARAMS, PROMPTS, moe_dir, routing_of  # noqa: F401
from trainer_bridge import EngineClient
from trainer_bridge import SamplingParams as WireSamplingParams


def test_served_routing_equals_the_engines(tmp_path_factory, moe_dir):  # noqa: F811
    expected = LLM(str(moe_dir), enable_return_routed_experts=True).generate(PROMPTS, PARAMS)
    process = start_server(tmp_path_factory, moe_dir, "--enable-return-routed-experts")
    params = WireSamplingParams(max_tokens=PARAMS.max_tokens, temperature=0, ignore_eos=True)
    try:
        with EngineClient(process.address, timeout=60) as client:
            client.wait_until_ready(30)
            batch = client.generate(PROMPTS, params)
            *_, streamed = client.generate_stream(PROMPTS[1], params)
    finally:
        assert process.stop() == 0, process.log()[-3000:]
    for want, got in zip(expected, batch):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert np.array_equal(routing_of(got), routing_of(want))
    assert np.array_equal(routing_of(streamed), routing_of(expected[1]))
