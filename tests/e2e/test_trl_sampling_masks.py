"""TRL's GRPOTrainer with top-k sampling and `sampling_masks=True`: the engine returns each
token's support and every TRL logprob is renormalised over it, so the importance-sampling
ratio is 1 within float32 noise; the control, the same top-k without masks, has TRL's
full-vocabulary logprobs far below the engine's truncated ones."""

from __future__ import annotations

import pytest

from tests.e2e.test_trl_backend import engine, make_trainer  # noqa: F401
from trainer_bridge import EngineClient
from trainer_bridge.trl_logps import SUPPORTS_KEY

TOP_K = 5


def train_one_step(client, llama_dir, tmp_path, sampling_masks: bool):
    trainer = make_trainer(llama_dir, tmp_path, client, max_steps=1, top_k=TOP_K,
                           sampling_masks=sampling_masks)
    batches = []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: batches.append(
        generate(inputs)) or batches[-1]
    trainer.train()
    return next(h for h in trainer.state.log_history if "reward" in h), batches[0]


def test_masks_make_the_importance_ratio_one(engine, llama_dir, tmp_path):  # noqa: F811
    client = EngineClient(engine.address, timeout=60)
    step, batch = train_one_step(client, llama_dir, tmp_path, sampling_masks=True)
    for key in ("min", "max"):
        assert step[f"sampling/importance_sampling_ratio/{key}"] == pytest.approx(1, abs=1e-3)
    supports, completions = batch[SUPPORTS_KEY], batch["completion_ids"]
    real = batch["completion_mask"].bool()
    assert supports.shape[:2] == completions.shape and supports.shape[2] == TOP_K
    assert (supports == completions[..., None]).any(-1)[real].all()
    assert ((supports >= 0).sum(-1)[real] == TOP_K).all()

    control, _ = train_one_step(client, llama_dir, tmp_path / "control", sampling_masks=False)
    assert control["sampling/importance_sampling_ratio/max"] < 0.5, control
    client.close()


def test_a_config_that_truncates_nothing_is_refused(client, llama_dir, tmp_path):
    with pytest.raises(ValueError, match="truncates nothing"):  # the shared server, untouched
        make_trainer(llama_dir, tmp_path, client, sampling_masks=True)
