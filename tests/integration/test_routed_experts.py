"""Routed experts (R3) on a Qwen3-MoE through the transformers backend: the engine returns the
experts of every position it read, prompt and output, cached and recomputed ones included; HF's
own routing of the same tokens agrees, and replayed into HF's forward it gives the engine's
logprobs (a different routing does not: the control)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import ModelLoadError
from rollout_engine.tiny_model import write_model_dir
from rollout_engine.worker.routed_experts import routers_of
from tests.integration.test_transformers_backend import CONFIGS, make_config
from trainer_bridge.routing_replay import replay_routing

PROMPTS = [[5, 17, 99, 250, 7, 31, 8, 64, 12], [3, 14, 15, 92, 65, 35]]
PARAMS = SamplingParams(max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("moe") / "qwen3_moe",
                           make_config(*CONFIGS["qwen3_moe"]))


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def routing_of(output) -> np.ndarray:
    """Prompt and output rows: every position the engine read."""
    return np.concatenate([output.prompt_routed_experts.to_numpy(),
                           output.outputs[0].routed_experts.to_numpy()])


@torch.inference_mode()
def hf_routing_and_logprobs(model, output, routed=None) -> tuple[np.ndarray, torch.Tensor]:
    """HF's routing of prompt + output[:-1] (the forward's own, or `routed` replayed) and the
    logprobs of the output tokens."""
    tokens = output.prompt_token_ids + output.outputs[0].token_ids
    seen = [None] * len(routers_of(model))
    hooks = [router.register_forward_hook(
        lambda module, args, out, layer=layer: seen.__setitem__(layer, out[-1]))
        for layer, router in enumerate(routers_of(model))]
    try:
        with replay_routing(model, routed) if routed is not None else _nothing():
            logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    prompt_len = len(output.prompt_token_ids)
    logprobs = torch.log_softmax(logits[prompt_len - 1:], -1)
    targets = torch.tensor(tokens[prompt_len:])
    return (torch.stack(seen, 1).numpy(),
            logprobs.gather(-1, targets[:, None])[:, 0])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_routing_matches_hf_and_replay_gives_the_engines_logprobs(moe_dir, hf_moe):
    llm = LLM(str(moe_dir), enable_return_routed_experts=True)
    outputs = llm.generate(PROMPTS, PARAMS)
    for output in outputs:
        routed = routing_of(output)
        num_tokens = len(output.prompt_token_ids) + len(output.outputs[0].token_ids)
        num_layers, top_k = routed.shape[1:]
        assert routed.shape == (num_tokens - 1, num_layers, top_k) and (routed >= 0).all()
        natural, _ = hf_routing_and_logprobs(hf_moe, output)
        # The same experts, as sets (top-k order aside), at every position.
        assert (np.sort(natural, -1) == np.sort(routed, -1)).all()
        engine = torch.tensor(output.outputs[0].logprobs)
        _, replayed = hf_routing_and_logprobs(hf_moe, output, routed)
        torch.testing.assert_close(replayed, engine, atol=1e-5, rtol=0)
        # The control: other experts give other logprobs.
        _, wrong = hf_routing_and_logprobs(hf_moe, output, (routed + 1) % hf_moe.config.num_experts)
        assert (wrong - engine).abs().max() > 1e-3


def test_prefix_hits_and_preemption_return_the_real_experts(moe_dir):
    reference = LLM(str(moe_dir), enable_return_routed_experts=True,
                    enable_prefix_caching=False).generate(PROMPTS, PARAMS)
    cached = LLM(str(moe_dir), enable_return_routed_experts=True, block_size=4)
    cached.generate(PROMPTS, PARAMS)
    again = cached.generate(PROMPTS, PARAMS)  # the prompts' blocks from the cache
    assert all(o.num_cached_tokens >= 4 for o in again)
    preempting = LLM(str(moe_dir), enable_return_routed_experts=True, num_blocks=6,
                     block_size=4, enable_prefix_caching=False)
    preempted = preempting.generate(PROMPTS, PARAMS)
    assert preempting.stats()["num_preemptions"] > 0
    for expected, *others in zip(reference, again, preempted):
        for other in others:
            assert other.outputs[0].token_ids == expected.outputs[0].token_ids
            assert np.array_equal(routing_of(other), routing_of(expected))


def test_a_dense_model_is_refused(llama_dir):
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        LLM(str(llama_dir), enable_return_routed_experts=True, model_impl="transformers")


@pytest.mark.parametrize("options", [
    pytest.param({"async_scheduling": True}, id="async-scheduling"),
    pytest.param({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2}}, id="ngram-drafts"),
])
def test_async_scheduling_and_drafts_return_the_real_experts(moe_dir, options):
    repetitive = [[5, 17, 99, 5, 17, 99, 5, 17, 99, 5], [3, 14, 3, 14, 3, 14, 3]]
    reference = LLM(str(moe_dir), enable_return_routed_experts=True).generate(repetitive, PARAMS)
    llm = LLM(str(moe_dir), enable_return_routed_experts=True, **options)
    outputs = llm.generate(repetitive, PARAMS)
    if "speculative_config" in options:
        assert sum(c.num_draft_tokens for o in outputs for c in o.outputs) > 0
    for expected, other in zip(reference, outputs):
        assert other.outputs[0].token_ids == expected.outputs[0].token_ids
        assert np.array_equal(routing_of(other), routing_of(expected))
