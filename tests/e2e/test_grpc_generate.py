"""Generation over gRPC returns exactly what the in-process `LLM.generate` returns."""

from __future__ import annotations

import itertools
import random

import pytest

from protos import rollout_pb2 as pb
from rollout_engine import SamplingParams as EngineSamplingParams
from tests.e2e.server_process import AUTH, ENGINE_OPTIONS
from trainer_bridge import SamplingParams

PROMPTS = [[random.Random(i).randrange(3, 500) for _ in range(4 + 3 * i)] for i in range(6)]
SETTINGS = {
    "greedy": {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True},
    "seeded_n3": {"n": 3, "temperature": 1.0, "top_p": 0.9, "max_tokens": 10, "seed": 11},
    "seeded_top_k": {"n": 2, "temperature": 0.8, "top_k": 20, "max_tokens": 8, "seed": 5,
                     "ignore_eos": True},
}


def assert_same(remote, local) -> None:
    assert len(remote) == len(local)
    for r, l in zip(remote, local):
        assert r.prompt_token_ids == l.prompt_token_ids
        assert len(r.outputs) == len(l.outputs)
        for rc, lc in zip(r.outputs, l.outputs):
            assert rc.index == lc.index
            assert rc.token_ids == lc.token_ids
            assert rc.logprobs == lc.logprobs  # bit-exact: doubles on the wire
            assert rc.finish_reason == lc.finish_reason
            assert rc.text == lc.text
            assert rc.weight_version == lc.weight_version


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_generate_batch_matches_in_process(client, llm, setting):
    remote = client.generate(PROMPTS, SamplingParams(**SETTINGS[setting]))
    local = llm.generate(PROMPTS, EngineSamplingParams(**SETTINGS[setting]))
    assert_same(remote, local)
    assert all(o.finished for r in remote for o in r.outputs)


def test_text_prompts_and_per_prompt_params(client, llm):
    prompts = ["the quick brown fox", "a river and a mountain"]
    settings = [SETTINGS["greedy"], SETTINGS["seeded_n3"]]
    remote = client.generate(prompts, [SamplingParams(**s) for s in settings])
    local = llm.generate(prompts, [EngineSamplingParams(**s) for s in settings])
    assert_same(remote, local)
    assert remote[0].prompt == prompts[0] and remote[0].outputs[0].text


@pytest.mark.parametrize("setting", ["greedy", "seeded_n3"])
def test_generate_stream_deltas_add_up_to_the_final_output(client, llm, setting):
    prompt = PROMPTS[3]
    snapshots = list(client.generate_stream(prompt, SamplingParams(**SETTINGS[setting])))
    (local,) = llm.generate([prompt], EngineSamplingParams(**SETTINGS[setting]))
    assert len(snapshots) > 2, "tokens should arrive in several messages"
    for earlier, later in itertools.pairwise(snapshots):
        for a, b in zip(earlier.outputs, later.outputs):
            assert b.token_ids[: len(a.token_ids)] == a.token_ids  # only ever appended
    final = snapshots[-1]
    assert final.finished
    final.request_id = local.request_id
    final.prompt = local.prompt
    assert_same([final], [local])


def test_generate_without_deltas_sends_only_final_outputs(raw_stub, llm):
    prompt = PROMPTS[2]
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(token_ids=prompt)),
        sampling_params=pb.SamplingParams(**SETTINGS["seeded_n3"]),
        stream_deltas=False,
    )
    messages = list(raw_stub.Generate(request, metadata=AUTH, timeout=60))
    assert not any(m.deltas for m in messages)
    finals = sorted((o for m in messages for o in m.outputs), key=lambda o: o.index)
    (local,) = llm.generate([prompt], EngineSamplingParams(**SETTINGS["seeded_n3"]))
    assert [list(o.token_ids) for o in finals] == [o.token_ids for o in local.outputs]
    assert list(messages[0].prompt_token_ids) == prompt


def test_info_reports_config_and_counters(client):
    info = client.info()
    assert info.config["cache_config"]["kv_cache_bytes"] == ENGINE_OPTIONS["kv_cache_bytes"]
    assert info.max_model_len == ENGINE_OPTIONS["max_model_len"]
    assert info.architecture == "LlamaForCausalLM" and info.vocab_size == 512
    assert 0 < info.num_free_blocks <= info.num_blocks
    before = info.num_generated_tokens_total
    client.generate([PROMPTS[0]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert client.info().num_generated_tokens_total == before + 5
