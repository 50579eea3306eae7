"""TRL's GRPOTrainer against a server with --batch-invariant, the trainer with
`batch_invariant=True`: the engine's sampling logprobs are the trainer's, bit for bit, at every
step (TRL's logprob difference exactly 0, its importance-sampling ratio exactly 1), the
policy still learns, and mixing the modes is refused."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from tests.e2e.test_trl_backend import PROMPTS, digit_reward
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl import EngineGRPOTrainer

ENGINE_OPTIONS = {"kv_cache_bytes": "8MiB", "max_model_len": 512}


def make_trainer(model_dir, tmp_path, client, batch_invariant: bool, **config):
    torch.manual_seed(0)
    options = {"per_device_train_batch_size": 8, "num_generations": 4,
               "max_completion_length": 8, "learning_rate": 3e-2, "max_steps": 2, "beta": 0.0,
               "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True,
               "bf16": False, "disable_tqdm": True, "seed": 0, "temperature": 0.7, **config}
    return EngineGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=digit_reward,
        args=GRPOConfig(output_dir=str(tmp_path / "trainer"), **options),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=AutoTokenizer.from_pretrained(model_dir), engine=client,
        generate_timeout_s=60, batch_invariant=batch_invariant)


@pytest.fixture(scope="module")
def invariant_engine(tmp_path_factory, llama_dir):
    log = tmp_path_factory.mktemp("invariant_engine") / "server.log"
    with EngineServer(llama_dir, engine_options={**ENGINE_OPTIONS, "batch_invariant": True},
                      log_path=log) as server:
        yield server


def test_the_engine_logprobs_are_the_trainers_at_every_step(invariant_engine, llama_dir,
                                                            tmp_path):
    client = EngineClient(invariant_engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, batch_invariant=True)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "reward" in h]
    assert len(steps) == 2
    for step in steps:
        assert step["sampling/sampling_logp_difference/max"] == 0.0, step
        for key in ("min", "mean", "max"):
            assert step[f"sampling/importance_sampling_ratio/{key}"] == 1.0, step
    assert trainer.engine_generation.colocation.weight_version == 2  # trained and pushed
    client.close()


def test_mixing_the_modes_is_refused(invariant_engine, llama_dir, tmp_path):
    client = EngineClient(invariant_engine.address, timeout=60)
    with pytest.raises(ValueError, match="pass batch_invariant=True"):
        make_trainer(llama_dir, tmp_path, client, batch_invariant=False)
    with pytest.raises(ValueError, match="autocast"):
        make_trainer(llama_dir, tmp_path, client, batch_invariant=True, bf16=True)
    client.close()
