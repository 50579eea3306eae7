"""TRL's AsyncGRPOTrainer with a PEFT LoRA policy against `serve --enable-lora --http-port`:
TRL reads the engine's LoRA capability from `/server_info`, each sync loads the adapter alone
as a new version (`trl-policy-v{N}`) that the worker's requests then name, the version that
fell out of the staleness window is unloaded, and the base weights never move. "memory"
pushes the adapter over gRPC (no disk); "path" is TRL's own sync through
`/v1/load_lora_adapter` (slow: the same checks on a second run)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM
from trl.experimental.async_grpo import AsyncGRPOConfig

from rollout_engine import SamplingParams
from tests.e2e.server_process import start_server
from tests.e2e.test_trl_async_grpo import PROMPTS, completion_length_reward
from tests.e2e.test_trl_backend import GREEDY_PROMPTS, NUM_GREEDY_TOKENS, hf_greedy
from tests.e2e.trl_async_helpers import TappedQueue, worker_tokenizer
from trainer_bridge import EngineClient
from trainer_bridge.lora_sync import PolicyAdapter
from trainer_bridge.trl_async import EngineAsyncGRPOTrainer

NUM_STEPS = 2
MAX_STALENESS = 1
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, llama_dir):
    # TRL asks for max_staleness + 2 adapter slots: the next version loads before the
    # oldest is unloaded.
    process = start_server(tmp_path_factory, llama_dir, "--http-port", "0", "--enable-lora",
                           "--max-loras", str(MAX_STALENESS + 2), "--max-lora-rank", "8")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.mark.parametrize("lora_sync", ["memory", pytest.param("path", marks=pytest.mark.slow)])
def test_async_grpo_syncs_the_adapter_alone(lora_server, llama_dir, tmp_path, lora_sync,
                                            cpu_trainer_kernels):
    tokenizer = worker_tokenizer(llama_dir)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=NUM_STEPS, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=16, token_budget=0, max_inflight_tasks=8,
        max_staleness=MAX_STALENESS, learning_rate=1e-2, report_to="none",
        vllm_server_base_url=lora_server.http_url, save_strategy="no", logging_steps=1,
        bf16=False, gradient_checkpointing=False,
    )
    client = EngineClient(lora_server.address, timeout=60)
    weight_version = client.info().weight_version
    trainer = EngineAsyncGRPOTrainer(
        model=str(llama_dir), reward_funcs=completion_length_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}]
                                                    for p in PROMPTS]}),
        processing_class=tokenizer, peft_config=LORA, engine=client, lora_sync=lora_sync,
    )
    cpu_trainer_kernels()
    trainer.rollout_queue = tapped = TappedQueue(trainer.rollout_queue)
    trainer.rollout_worker.stop = tapped.drain_while(trainer.rollout_worker.stop)
    policy = PolicyAdapter(trainer.model)
    before = {name: t.clone() for name, t in policy.adapter().items()}
    trainer.train()
    assert any(not t.equal(before[name]) for name, t in policy.adapter().items())

    # A cold sync, then one per step: each a new adapter version; the base never moved.
    versions = [f"trl-policy-v{n}" for n in range(1, NUM_STEPS + 2)]
    assert trainer.model_version == len(versions)
    assert client.info().weight_version == weight_version
    loaded = {a.lora_name: a for a in client.list_lora_adapters()}
    assert sorted(loaded) == versions[-(MAX_STALENESS + 1):]  # the stale ones unloaded
    if lora_sync == "memory":
        syncs = trainer.engine_transfer.syncs
        assert [s.adapter.lora_name for s in syncs] == versions
        assert all(s.adapter.lora_path == "" for s in syncs)  # from memory, not a path
        model_bytes = sum(t.numel() * t.element_size() for _, t in policy.base_weights())
        assert {s.num_bytes for s in syncs} == {policy.num_adapter_bytes()}
        assert policy.num_adapter_bytes() * 5 < model_bytes
    else:
        assert all(a.lora_path.startswith(str(tmp_path)) for a in loaded.values())

    # Samples were generated under the adapter and scored by the trainer as the engine did:
    # at staleness 0 (the first step) the importance ratio is 1.
    assert len(tapped.samples) >= NUM_STEPS * args.per_device_train_batch_size
    first_step = trainer.state.log_history[0]
    assert first_step["sample/staleness_max"] == 0, first_step
    assert first_step["kl"] < 1e-6 and first_step["ratio"] == pytest.approx(1, abs=1e-5)
    assert all(np.isfinite(s.old_log_probs).all() for s in tapped.samples)

    # The last version is the trained policy: PEFT's greedy tokens with the trained adapter
    # (on a fresh model: the trainer's runs TRL's packed attention).
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    oracle = get_peft_model(base, LORA)
    set_peft_model_state_dict(oracle, policy.adapter())
    params = SamplingParams(max_tokens=NUM_GREEDY_TOKENS, temperature=0, ignore_eos=True)
    outputs = client.generate(GREEDY_PROMPTS, params, lora_name=versions[-1])
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(
        oracle, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
    for name in loaded:  # the next run loads the same names
        client.unload_lora_adapter(name)
    client.close()
