"""Sampling masks on a tiny real model, with Hugging Face as the oracle: the same top-k / top-p
applied to HF's logits of the sampled prefix gives the engine's masks, the sampled token is in
its mask, the trainer's renormalised logprobs are the engine's, greedy masks are the argmax,
and speculative decoding returns the masks of decoding without it."""

from __future__ import annotations

import pytest
import torch

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import InvalidRequestError
from tests.integration.hf_oracle import hf_greedy, load_hf_model
from tests.integration.test_spec_decode import repetitive_prompts
from tests.unit.test_sampler import reference_filter
from trainer_bridge.masked_logprobs import masked_logprobs

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
# 4-token blocks and an 8-token budget: prompts are chunked, samples share cached blocks.
ENGINE_OPTIONS = {"block_size": 4, "max_num_batched_tokens": 8, "num_blocks": 64,
                  "async_scheduling": True}
TOP_P_MARGIN = 1e-4
"""Top-p is decided in float32 on slightly different logits: a token whose mass before it is
this close to top_p may fall either way."""


@pytest.fixture(scope="module")
def model_dir(llama_dir) -> str:
    return str(llama_dir)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE_OPTIONS)


def sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"n": 2, "max_tokens": 12, "ignore_eos": True, "seed": 3,
                             "return_sampling_mask": True, **kwargs})


@torch.inference_mode()
def hf_logits(model_dir: str, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V]: HF's logits at the positions that predicted each token."""
    logits = load_hf_model(model_dir)(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def hf_supports(logits: torch.Tensor, params: SamplingParams, top_p: float) -> list[set[int]]:
    """Per position, what the sampler's filters keep of HF's logits (float64 reference)."""
    scaled = logits / params.temperature
    return [set(reference_filter(row, params.top_k, top_p, params.min_p).isfinite()
                .nonzero()[:, 0].tolist()) for row in scaled]


@pytest.mark.parametrize("filters", [{"top_k": 7}, {"top_p": 0.6}, {"top_k": 20, "top_p": 0.8}],
                         ids=["top_k", "top_p", "top_k_top_p"])
def test_masks_are_hf_logits_filtered_the_same_way(llm, model_dir, filters):
    params = sampled(temperature=0.8, **filters)
    num_sharp = num_positions = 0
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params)):
        for completion in output.outputs:
            tokens, mask = completion.token_ids, completion.sampling_mask
            assert len(mask) == len(tokens) == 12
            logits = hf_logits(model_dir, prompt, tokens)
            # Top-p keeps more as top_p grows: the engine's mask lies between the two.
            margin = TOP_P_MARGIN if params.top_p < 1.0 else 0.0
            inner = hf_supports(logits, params, params.top_p - margin)
            outer = hf_supports(logits, params, min(params.top_p + margin, 1.0))
            for token, ids, low, high in zip(tokens, mask.to_lists(), inner, outer):
                assert token in ids and ids == sorted(ids)
                assert low <= set(ids) <= high
                num_sharp += low == high
            num_positions += len(tokens)
            # The trainer's logprobs over the mask are the engine's.
            got = masked_logprobs(logits, tokens, mask, params.temperature)
            torch.testing.assert_close(got, torch.tensor(completion.logprobs), atol=1e-4, rtol=0)
    assert num_sharp >= 0.8 * num_positions  # most positions have one answer: checked exactly
    assert max(len(ids) for ids in mask.to_lists()) > 1


def test_a_greedy_mask_is_the_argmax_alone(llm, model_dir):
    params = sampled(n=1, temperature=0.0, max_tokens=8)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params)):
        completion = output.outputs[0]
        assert completion.token_ids == hf_greedy(model_dir, prompt, 8)
        assert completion.sampling_mask.to_lists() == [[t] for t in completion.token_ids]


def test_only_the_requests_that_ask_get_masks(llm):
    asking, plain = llm.generate(PROMPTS, [sampled(top_k=5), SamplingParams(top_k=5, seed=3)])
    assert all(len(c.sampling_mask) == len(c.token_ids) for c in asking.outputs)
    assert all(c.sampling_mask is None for c in plain.outputs)


def test_speculative_decoding_returns_the_masks_of_decoding_without_it(llama_dir):
    """One mask per accepted token, each from the distribution its token was verified against:
    the same tokens and masks as without drafts (a position's draw is its own)."""
    prompts = repetitive_prompts(4)
    params = sampled(temperature=0.3, top_k=4, max_tokens=16)
    plain = LLM(str(llama_dir)).generate(prompts, params)
    drafting = LLM(str(llama_dir), num_speculative_tokens=3)
    spec = drafting.generate(prompts, params)
    assert drafting.stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
            assert y.sampling_mask == x.sampling_mask


def test_the_engine_wide_switch_gives_every_request_its_masks(model_dir, llm):
    """vLLM's `LLM(..., return_sampling_mask=True)`: no request needs to ask."""
    asked = llm.generate(PROMPTS, sampled(top_k=7))
    everyone = LLM(model_dir, return_sampling_mask=True, **ENGINE_OPTIONS)
    outputs = everyone.generate(PROMPTS, sampled(top_k=7, return_sampling_mask=False))
    for expected, output in zip(asked, outputs):
        for x, y in zip(expected.outputs, output.outputs):
            assert y.token_ids == x.token_ids and y.sampling_mask == x.sampling_mask
            assert y.sampling_mask.token_ids == y.sampling_mask.to_lists()  # vLLM's lists
            assert all(len(ids) == 7 for ids in y.sampling_mask.token_ids)
    with pytest.raises(InvalidRequestError, match="nothing truncates"):
        everyone.generate(PROMPTS, SamplingParams(max_tokens=2))
    assert everyone.generate(PROMPTS[:1], sampled(top_p=0.5))[0].outputs[0].sampling_mask
