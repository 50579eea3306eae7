"""TRL's GRPOTrainer with a PEFT LoRA policy through an engine serving with --enable-lora:
each step pushes only the adapter (no merge, the base once), generation runs under it, and
the engine's sampling logprobs equal the trainer's (importance-sampling ratio 1 within 1e-5)."""

from __future__ import annotations

import pytest
from peft import LoraConfig

from rollout_engine import SamplingParams
from rollout_engine.tiny_model import write_model_dir
from tests.e2e.test_trl_backend import GREEDY_PROMPTS, NUM_GREEDY_TOKENS, hf_greedy, make_trainer
from tests.integration.test_transformers_backend import CONFIGS, make_config
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory, llama_dir):
    options = {"kv_cache_bytes": "8MiB", "max_model_len": 48, "enable_lora": True,
               "max_lora_rank": 8}
    log_path = tmp_path_factory.mktemp("lora_engine") / "server.log"
    with EngineServer(llama_dir, engine_options=options, log_path=log_path) as server:
        yield server


def test_grpo_with_a_lora_policy_syncs_only_the_adapter(lora_engine, llama_dir, tmp_path):
    client = EngineClient(lora_engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, peft_config=LORA, sleep_level=1)
    backend = trainer.engine_generation
    assert backend.policy_adapter is not None
    before = {k: v.clone() for k, v in backend.policy_adapter.adapter().items()}
    trainer.train()
    after = backend.policy_adapter.adapter()
    assert any(not after[k].equal(v) for k, v in before.items())  # the adapter trained
    steps = [h for h in trainer.state.log_history if "reward" in h]
    assert len(steps) == 2
    for step in steps:
        assert step["sampling/sampling_logp_difference/max"] < 1e-5, step
        for key in ("min", "mean", "max"):
            assert step[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(
                1.0, abs=1e-5), step
    colocation = backend.colocation
    assert colocation.num_weight_pushes == 1  # the base, once
    assert colocation.num_adapter_pushes == 2
    adapter_bytes = backend.policy_adapter.num_adapter_bytes()
    model_bytes = sum(p.numel() * p.element_size() for _, p in
                      backend.policy_adapter.base_weights())
    assert adapter_bytes * 5 < model_bytes
    # The engine serves the trained policy: the PEFT model's own greedy tokens.
    trainer.sync_engine_weights()
    expected = hf_greedy(trainer.model, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
    params = SamplingParams(max_tokens=NUM_GREEDY_TOKENS, temperature=0, ignore_eos=True)
    outputs = client.generate(GREEDY_PROMPTS, params, lora_name="policy")
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [a.lora_name for a in client.list_lora_adapters()] == ["policy"]
    client.close()


@pytest.mark.slow  # a server of its own, for one refusal
def test_lora_sync_refused_on_an_engine_without_lora(tmp_path_factory, llama_dir, tmp_path):
    log_path = tmp_path_factory.mktemp("plain") / "server.log"
    with EngineServer(llama_dir, engine_options={"kv_cache_bytes": "8MiB", "max_model_len": 48},
                      log_path=log_path) as server:
        client = EngineClient(server.address, timeout=60)
        with pytest.raises(ValueError, match="enable-lora"):
            make_trainer(llama_dir, tmp_path, client, peft_config=LORA, lora_sync=True)
        client.close()


@pytest.mark.slow  # a MoE server of its own (about 20 s)
def test_grpo_with_a_lora_policy_on_moe_experts(tmp_path):
    """A PEFT policy on a Qwen3-MoE's experts (`target_parameters`) and attention: each step
    pushes the adapter, whose expert deltas the engine applies unmerged (ratio 1 within 1e-5),
    and the engine then serves the trained policy's greedy tokens."""
    moe_dir = write_model_dir(tmp_path / "qwen3_moe", make_config(*CONFIGS["qwen3_moe"]))
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"],
                             init_lora_weights=False)
    options = {"kv_cache_bytes": "8MiB", "max_model_len": 48, "enable_lora": True,
               "max_lora_rank": 8}
    with EngineServer(moe_dir, engine_options=options, log_path=tmp_path / "server.log") as server:
        client = EngineClient(server.address, timeout=60)
        trainer = make_trainer(moe_dir, tmp_path, client, peft_config=peft_config,
                               sleep_level=1)
        adapter = trainer.engine_generation.policy_adapter.adapter()
        assert any(".experts.base_layer.lora_A" in name for name in adapter)
        trainer.train()
        steps = [h for h in trainer.state.log_history if "reward" in h]
        assert len(steps) == 2
        for step in steps:
            assert step["sampling/sampling_logp_difference/max"] < 1e-5, step
        assert trainer.engine_generation.colocation.num_adapter_pushes == 2
        trainer.sync_engine_weights()
        expected = hf_greedy(trainer.model, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
        params = SamplingParams(max_tokens=NUM_GREEDY_TOKENS, temperature=0, ignore_eos=True)
        outputs = client.generate(GREEDY_PROMPTS, params, lora_name="policy")
        assert [o.outputs[0].token_ids for o in outputs] == expected
        client.close()
