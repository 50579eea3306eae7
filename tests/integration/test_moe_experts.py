"""A Qwen3-MoE through the transformers backend runs its experts on our grouped kernel
(`rollout_engine/worker/models/experts.py`): the packed copies exist while serving, follow weight
updates and sleep, and the greedy tokens are Hugging Face's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels import cpu_extension
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import write_model_dir
from rollout_engine.worker.models.experts import EXPERTS_NAME
from tests.integration.test_transformers_backend import CONFIGS, make_config

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="no compiled CPU kernel")
PROMPTS = [[5, 17, 99, 250, 7, 31], [3, 14, 15, 92]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def packed_experts_of(llm: LLM) -> list:
    model = llm.engine.worker.model_runner.model
    assert model.config._experts_implementation == EXPERTS_NAME
    return [m.packed_experts for m in model.modules() if hasattr(m, "packed_experts")]


def test_experts_run_packed_and_give_hf_greedy_tokens(tmp_path):
    model_dir = write_model_dir(tmp_path / "qwen3_moe", make_config(*CONFIGS["qwen3_moe"]))
    llm = LLM(str(model_dir), model_impl="transformers")
    outputs = llm.generate(PROMPTS, GREEDY)
    packed = packed_experts_of(llm)
    assert packed and all(p is not None for p in packed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert tokens_of(outputs) == hf_greedy(hf)

    # Level 2 discards the weights, and their packed copies with them; an update packs anew.
    llm.sleep(level=2)
    assert all(p is None for p in packed_experts_of(llm))
    llm.wake_up()
    with torch.no_grad():  # new expert weights: stale packed copies would give other tokens
        for name, parameter in hf.named_parameters():
            if ".experts." in name:
                parameter.mul_(-3.0)
    llm.update_weights(hf.named_parameters())
    updated = llm.generate(PROMPTS, GREEDY)
    assert tokens_of(updated) == hf_greedy(hf) != tokens_of(outputs)
    assert all(p is not None for p in packed_experts_of(llm))


def tokens_of(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@torch.inference_mode()
def hf_greedy(hf) -> list[list[int]]:
    return [hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                        do_sample=False)[0, len(prompt):].tolist() for prompt in PROMPTS]
