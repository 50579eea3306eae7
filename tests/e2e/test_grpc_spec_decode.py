"""Speculative decoding reaches the server: `serve --num-speculative-tokens` (n-gram) or
`--speculative-config` (vLLM's JSON; suffix drafting), GetInfo stats and `/metrics`."""

from __future__ import annotations

import pytest
import requests

from tests.e2e.server_process import start_server
from tests.integration.test_spec_decode import GREEDY, PROMPTS
from trainer_bridge import EngineClient
from trainer_bridge import SamplingParams as WireSamplingParams


# A server of its own (about 23 s): in `make test-all`, so the fresh-clone suite stays under 10
# minutes. The fast suite covers speculation in process (tests/integration/test_spec_decode.py).
@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ("--num-speculative-tokens", "3"),
    ("--speculative-config", '{"method": "suffix", "num_speculative_tokens": 3}'),
], ids=["ngram", "suffix"])
def test_served_speculation_gives_the_same_tokens_and_reports_stats(tmp_path_factory, llama_dir,
                                                                    flags):
    from rollout_engine import LLM

    expected = LLM(str(llama_dir)).generate(PROMPTS, GREEDY)
    process = start_server(tmp_path_factory, llama_dir, "--http-port", "0", *flags)
    try:
        with EngineClient(process.address, timeout=60) as client:
            client.wait_until_ready(30)
            params = WireSamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)
            outputs = client.generate(PROMPTS, params)
            stats = client.info().engine_stats
        metrics = requests.get(f"{process.http_url}/metrics", timeout=30).text
    finally:
        assert process.stop() == 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert sum(o.outputs[0].num_accepted_draft_tokens for o in outputs) == (
        stats["spec_num_accepted_tokens"])
    assert ("spec_suffix_cached_tokens" in stats) == (flags[0] == "--speculative-config")
    rate = next(line for line in metrics.splitlines()
                if line.startswith("rollout_engine_spec_accept_rate{"))
    assert float(rate.rsplit(" ", 1)[1]) == pytest.approx(stats["spec_acceptance_rate"])
