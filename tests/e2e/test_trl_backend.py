"""TRL's GRPOTrainer generating through a real engine server: weight pushes, importance
sampling ratio, parity with the trainer's model, and an engine that dies mid-rollout."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TrainerCallback
from trl import GRPOConfig

from trainer_bridge import (
    DeadlineExceededError,
    EngineClient,
    SamplingParams,
    UnavailableError,
)
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl import EngineGRPOTrainer

ENGINE_OPTIONS = {"kv_cache_bytes": "8MiB", "max_model_len": 512}
PROMPTS = ["the old man walked to", "a new idea", "once upon a time", "children learn"]
GREEDY_PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90]]
NUM_GREEDY_TOKENS = 12


@pytest.fixture
def engine(tmp_path, llama_dir):
    with EngineServer(llama_dir, engine_options=ENGINE_OPTIONS,
                      log_path=tmp_path / "server.log") as server:
        yield server


def digit_reward(completion_ids, **kwargs) -> list[float]:
    digits = range(17, 27)  # the tiny tokenizer's "0".."9"
    return [sum(t in digits for t in ids) / max(len(ids), 1) for ids in completion_ids]


class VersionRecorder(TrainerCallback):
    """The engine's weight version at the end of each optimizer step."""

    def __init__(self, client: EngineClient) -> None:
        self.client, self.versions = client, []

    def on_step_end(self, args, state, control, **kwargs):
        self.versions.append(self.client.info().weight_version)


def make_trainer(
    model_dir: Path,
    tmp_path: Path,
    client: EngineClient,
    *,
    peft_config=None,
    rollout_func=None,
    weight_dtype=None,
    sleep_level=2,
    lora_sync=None,
    sampling_masks=False,
    **config,
) -> EngineGRPOTrainer:
    """A GRPO trainer on the tiny model; `config` overrides GRPOConfig fields."""
    torch.manual_seed(0)
    options = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 8,
               "learning_rate": 3e-2, "max_steps": 2, "beta": 0.0, "logging_steps": 1,
               "report_to": "none", "save_strategy": "no", "use_cpu": True, "bf16": False,
               "disable_tqdm": True, "seed": 0, **config}
    return EngineGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=digit_reward, args=GRPOConfig(output_dir=str(tmp_path / "trainer"), **options),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=AutoTokenizer.from_pretrained(model_dir), engine=client,
        generate_timeout_s=60, peft_config=peft_config, rollout_func=rollout_func,
        weight_dtype=weight_dtype, sleep_level=sleep_level, lora_sync=lora_sync,
        sampling_masks=sampling_masks,
    )


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' generate, EOS ignored."""
    model.eval()
    config = GenerationConfig(max_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    # generate fills a passed config's unset fields (eos_token_id=None among them) from the
    # model's own: only None there lets a greedy EOS go on, as the engine's ignore_eos does.
    model_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    results = []
    try:
        for prompt in prompts:
            input_ids = torch.tensor([prompt])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config)
            tokens = out[0, len(prompt):].tolist()
            assert len(tokens) == num_tokens, f"HF stopped early: {tokens}"
            results.append(tokens)
    finally:
        model.generation_config.eos_token_id = model_eos
    return results


def engine_greedy(client: EngineClient) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in client.generate(GREEDY_PROMPTS, params)]


def test_grpo_two_steps_through_the_engine(engine, llama_dir, tmp_path):
    client = EngineClient(engine.address, timeout=60)
    before = engine_greedy(client)
    trainer = make_trainer(llama_dir, tmp_path, client)
    recorder = VersionRecorder(client)
    trainer.add_callback(recorder)
    trainer.train()

    assert recorder.versions == [1, 2]  # the trainer's weights pushed before each rollout
    assert trainer.engine_generation.colocation.weight_version == 2
    first = next(h for h in trainer.state.log_history if "reward" in h)
    # The engine's logprobs of the sampled tokens are the trainer's own, recomputed.
    assert first["sampling/sampling_logp_difference/max"] < 1e-3, first
    for key in ("min", "mean", "max"):
        assert first[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(1.0, abs=1e-3)
    assert client.memory_state().is_sleeping  # asleep after the last rollout (level 2)

    assert trainer.sync_engine_weights() == 3
    after = engine_greedy(client)
    assert after == hf_greedy(trainer.model, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
    assert after != before, "training should have changed the greedy continuations"
    client.close()


def kill_when_generating(server: EngineServer, timeout_s: float = 60.0) -> threading.Thread:
    """SIGKILL the server as soon as it has a generation in flight."""
    def watch() -> None:
        with EngineClient(server.address, timeout=5) as watcher:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if watcher.info().num_inflight_requests > 0:
                    server.kill()
                    return
                time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_engine_death_mid_rollout_then_a_restarted_engine_serves(engine, llama_dir, tmp_path):
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, max_steps=1, max_completion_length=300,
                           generation_kwargs={"ignore_eos": True})
    watcher = kill_when_generating(engine)
    start = time.monotonic()
    with pytest.raises(UnavailableError) as failure:
        trainer.train()
    assert time.monotonic() - start < 30
    watcher.join(5)
    assert not engine.is_running
    assert any("restart it" in note for note in failure.value.__notes__)

    engine.restart()
    restarted = EngineClient(engine.address, timeout=60)
    trainer.attach_engine(restarted)
    trainer.train()  # the next step runs on the new engine, with the trainer's weights
    assert restarted.info().weight_version == 1
    assert [h for h in trainer.state.log_history if "reward" in h]
    client.close()
    restarted.close()


def test_hung_engine_fails_at_the_generate_deadline(engine, llama_dir, tmp_path):
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, max_steps=1)
    backend = trainer.engine_generation
    backend.generate_timeout_s = 2.0
    backend.sync_weights()
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            backend.generate([[3, 14, 15]] * 4, None, num_generations=4)
        assert time.monotonic() - start < 10
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    client.close()
