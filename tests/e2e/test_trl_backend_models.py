"""TRL's GRPOTrainer through a real engine server running the transformers backend: a MoE
model (Qwen3-MoE: fused experts in the trainer's `named_parameters()`) and a sliding-window
one (Gemma 3). The weights pushed, the engine's logprobs and its greedy tokens are the
trainer's."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollout_engine.tiny_model import write_model_dir
from tests.e2e.test_trl_backend import (
    ENGINE_OPTIONS,
    GREEDY_PROMPTS,
    NUM_GREEDY_TOKENS,
    VersionRecorder,
    engine_greedy,
    hf_greedy,
    make_trainer,
)
from tests.integration.test_transformers_backend import CONFIGS, make_config
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer

FAMILIES = ("qwen3_moe", "gemma3_text")
# The small configs hold 256 positions.
OPTIONS = {**ENGINE_OPTIONS, "max_model_len": 256, "model_impl": "transformers"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[dict[str, tuple[Path, EngineServer]]]:
    """family -> (its small model's directory, an engine server on it). The servers start at
    once: a start is mostly imports and the model's load, one process each."""
    root = tmp_path_factory.mktemp("trl_models")
    model_dirs = {family: write_model_dir(root / family, make_config(*CONFIGS[family]))
                  for family in FAMILIES}

    def start(family: str) -> EngineServer:
        return EngineServer(model_dirs[family], engine_options=OPTIONS,
                            log_path=root / f"{family}.log")

    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        servers = dict(zip(FAMILIES, pool.map(start, FAMILIES)))
    yield {family: (model_dirs[family], servers[family]) for family in FAMILIES}
    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        exit_codes = dict(zip(FAMILIES, pool.map(EngineServer.stop, servers.values())))
    logs = {family: server.log()[-3000:] for family, server in servers.items()}
    assert exit_codes == dict.fromkeys(FAMILIES, 0), logs


@pytest.mark.parametrize("family", FAMILIES)
def test_a_grpo_step_through_the_transformers_backend(engines, tmp_path, family):
    model_dir, server = engines[family]
    with EngineClient(server.address, timeout=60) as client:
        before = engine_greedy(client)
        trainer = make_trainer(model_dir, tmp_path, client, max_steps=1)
        recorder = VersionRecorder(client)
        trainer.add_callback(recorder)
        trainer.train()

        assert recorder.versions == [1]  # the trainer's weights pushed before the rollout
        step = next(h for h in trainer.state.log_history if "reward" in h)
        # The engine's logprobs of the sampled tokens are the trainer's own, recomputed.
        assert step["sampling/sampling_logp_difference/max"] < 1e-3, step
        assert trainer.sync_engine_weights() == 2
        after = engine_greedy(client)
        assert after == hf_greedy(trainer.model, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
        assert after != before, "the training step should have changed the greedy tokens"
