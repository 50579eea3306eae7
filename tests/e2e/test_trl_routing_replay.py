"""TRL's GRPOTrainer on a Qwen3-MoE with `routing_replay=True`, against a server with
--enable-return-routed-experts: two steps (weights pushed between them, a reference model,
activation checkpointing in the loss) in which every TRL forward replays the engine's experts,
so the importance-sampling ratio is 1 and the sampler-trainer KL (k3) 0 within float32 noise
(exactly, with both sides batch-invariant); an engine that does not return its experts is
refused."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from rollout_engine.tiny_model import write_model_dir
from rollout_engine.worker.routed_experts import routers_of
from tests.e2e.test_trl_backend import PROMPTS, digit_reward
from tests.integration.test_transformers_backend import CONFIGS, make_config
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl import EngineGRPOTrainer
from trainer_bridge.trl_routing import ROUTING_KEY

ENGINE_OPTIONS = {"kv_cache_bytes": "8MiB", "max_model_len": 256}


class RecordingTrainer(EngineGRPOTrainer):
    """Keeps each generation batch (TRL's old logprobs beside the engine's)."""

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.batches = [*getattr(self, "batches", []), batch]
        return batch


def make_trainer(model_dir, tmp_path, client, batch_invariant: bool = False,
                 **config) -> RecordingTrainer:
    torch.manual_seed(0)
    options = {"per_device_train_batch_size": 8, "num_generations": 4,
               "max_completion_length": 8, "learning_rate": 3e-2, "max_steps": 2, "beta": 0.04,
               "logging_steps": 1, "report_to": "none", "save_strategy": "no", "use_cpu": True,
               "bf16": False, "disable_tqdm": True, "seed": 0, "temperature": 1.0,
               "gradient_checkpointing": True, **config}
    return RecordingTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=digit_reward,
        args=GRPOConfig(output_dir=str(tmp_path / "trainer"), **options),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=AutoTokenizer.from_pretrained(model_dir), engine=client,
        generate_timeout_s=60, routing_replay=True, batch_invariant=batch_invariant)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("moe") / "qwen3_moe",
                           make_config(*CONFIGS["qwen3_moe"]))


def record_router_calls(*models) -> list[bool]:
    """Per router call of `models`: whether its forward was the replaying one."""
    calls: list[bool] = []
    for model in models:
        for router in routers_of(model):
            router.register_forward_pre_hook(
                lambda module, args: calls.append("forward" in module.__dict__))
    return calls


@pytest.mark.parametrize("batch_invariant", [
    pytest.param(False, id="float32"),
    pytest.param(True, marks=pytest.mark.slow, id="batch-invariant")])
def test_grpo_steps_replay_the_engines_experts(moe_dir, tmp_path, batch_invariant):
    """Batch-invariant on both sides: the ratio is exactly 1 (about 10 s more)."""
    options = {**ENGINE_OPTIONS, "enable_return_routed_experts": True,
               "batch_invariant": batch_invariant}
    with EngineServer(moe_dir, engine_options=options, log_path=tmp_path / "server.log") as server:
        client = EngineClient(server.address, timeout=60)
        trainer = make_trainer(moe_dir, tmp_path, client, batch_invariant)
        router_calls = record_router_calls(trainer.model, trainer.ref_model)
        trainer.train()
        client.close()
    # Per step and MoE layer: old logprobs, reference, loss forward and its recompute.
    assert len(router_calls) == 2 * 2 * 4 and all(router_calls)
    steps = [h for h in trainer.state.log_history if "reward" in h]
    assert len(steps) == 2 and trainer.engine_generation.colocation.weight_version == 2
    tolerance = 0.0 if batch_invariant else 1e-5
    for step, batch in zip(steps, trainer.batches, strict=True):
        for key in ("min", "max"):
            assert abs(step[f"sampling/importance_sampling_ratio/{key}"] - 1) <= tolerance, step
        mask = batch["completion_mask"].bool()
        log_ratio = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"])[mask]
        k3 = (log_ratio.exp() - 1 - log_ratio).mean().item()
        assert k3 < 1e-8 and (k3 == 0 or not batch_invariant), step
        routing = batch[ROUTING_KEY]  # TRL's layout: -1 on padding (and each last token)
        assert routing.shape[:2] == (8, batch["prompt_ids"].size(1) + mask.size(1))
        real = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).bool()
        assert ((routing >= 0).all(-1).all(-1) <= real).all()
    assert steps[0]["kl"] < 1e-8  # the first step's policy is the (replayed) reference


def test_an_engine_without_routed_experts_is_refused(moe_dir, tmp_path, client):
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        make_trainer(moe_dir, tmp_path, client)  # the shared server, a dense model's
