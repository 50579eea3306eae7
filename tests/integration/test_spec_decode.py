"""Speculative decoding end to end: greedy outputs unchanged, sampling distribution exact."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from rollout_engine import LLM, SamplingParams
from tests.conftest import ARCHS
from tests.integration.hf_oracle import hf_greedy_batch, load_hf_model

MAX_NEW_TOKENS = 24
K = 3


def repetitive_prompts(num_prompts: int = 12, seed: int = 1) -> list[list[int]]:
    """Prompts that repeat spans of themselves, so the n-gram proposer finds matches."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        span = [rng.randrange(3, 500) for _ in range(rng.randint(4, 12))]
        filler = [rng.randrange(3, 500) for _ in range(rng.randint(0, 10))]
        prompts.append(span + filler + span + filler + span[: rng.randint(2, len(span))])
    return prompts


PROMPTS = repetitive_prompts()
SETTINGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_blocks": 40, "block_size": 4, "enable_prefix_caching": False},
    "prefix_caching": {"enable_prefix_caching": True, "block_size": 4},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dirs) -> dict[str, list[list[int]]]:
    return {arch: hf_greedy_batch(str(tiny_model_dirs[arch]), PROMPTS, MAX_NEW_TOKENS) for arch in ARCHS}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_speculation_matches_transformers(tiny_model_dirs, hf_reference, arch, setting):
    llm = LLM(str(tiny_model_dirs[arch]), num_speculative_tokens=K, **SETTINGS[setting])
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_reference[arch]
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"]
    if setting == "preemption":
        assert stats["num_preemptions"] > 0


def test_logprobs_with_speculation_equal_those_without(llama_dir):
    plain = LLM(str(llama_dir)).generate(PROMPTS, GREEDY)
    llm = LLM(str(llama_dir), num_speculative_tokens=K)
    spec = llm.generate(PROMPTS, GREEDY)
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor(b.outputs[0].logprobs), torch.tensor(a.outputs[0].logprobs),
            atol=1e-4, rtol=0,
        )


# ---------------------------------------------------------------- distribution exactness
VOCAB = 6
# Every bigram [2, x] is followed by [4, 2] earlier in the prompt, so whatever the first
# sampled token x is, the proposer drafts [4, 2] for the second and third tokens.
DIST_PROMPT = [t for x in range(VOCAB) for t in (2, x, 4)] + [2]
MAX_TOKENS = 4
NUM_SAMPLES = 3000


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory) -> str:
    """A one-layer model over 6 tokens: continuation distributions are enumerable exactly."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model_dir = tmp_path_factory.mktemp("vocab6")
    LlamaForCausalLM(config).save_pretrained(model_dir)
    GenerationConfig().save_pretrained(model_dir)
    return str(model_dir)


@torch.inference_mode()
def next_token_probs(model_dir: str, prefixes: list[list[int]], temperature: float) -> torch.Tensor:
    model = load_hf_model(model_dir)
    logits = model(torch.tensor([DIST_PROMPT + p for p in prefixes])).logits[:, -1]
    return torch.softmax(logits / temperature, -1)  # [len(prefixes), V]


def exact_second_third(model_dir: str, temperature: float) -> torch.Tensor:
    """P(t2, t3 | prompt), marginal over t1: [VOCAB, VOCAB]."""
    p1 = next_token_probs(model_dir, [[]], temperature)[0]  # [V]
    p2 = next_token_probs(model_dir, [[a] for a in range(VOCAB)], temperature)  # [V(t1), V]
    pairs = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p3 = next_token_probs(model_dir, pairs, temperature).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


def empirical_second_third(model_dir: str, temperature: float, k: int) -> torch.Tensor:
    llm = LLM(model_dir, num_speculative_tokens=k, disable_by_batch_size=10**6,
              max_num_seqs=512, block_size=4)
    params = SamplingParams(n=NUM_SAMPLES, temperature=temperature, max_tokens=MAX_TOKENS, seed=7)
    (output,) = llm.generate([DIST_PROMPT], params)
    counts = torch.zeros(VOCAB, VOCAB)
    for completion in output.outputs:
        counts[completion.token_ids[1], completion.token_ids[2]] += 1
    if k:
        assert llm.stats()["spec_num_drafts"] >= 2 * NUM_SAMPLES  # every sample verified 2 drafts
    return counts / NUM_SAMPLES


def test_sampling_with_speculation_follows_the_target_distribution(small_vocab_model):
    temperature = 1.3
    exact = exact_second_third(small_vocab_model, temperature)
    # Total variation distance; with 3000 samples over 36 cells its sampling noise is
    # about sqrt(36 / 3000) / 2 ~ 0.055 at most, so 0.08 is a generous bound.
    bound = 0.08
    empirical = {k: empirical_second_third(small_vocab_model, temperature, k) for k in (0, 3)}
    for k, dist in empirical.items():
        tv = 0.5 * (dist - exact).abs().sum().item()
        assert tv < bound, f"k={k}: TV {tv:.3f} from the exact distribution"
    assert 0.5 * (empirical[3] - empirical[0]).abs().sum().item() < bound
    # A rule that accepted the drafts [4, 2] unconditionally lands far outside the bound,
    # and the drafts are genuinely uncertain (accepted with probability well below 1).
    always_accept = torch.zeros_like(exact)
    always_accept[4, 2] = 1.0
    assert 0.5 * (always_accept - exact).abs().sum().item() > 3 * bound
    assert exact[4, 2] < 0.5


def test_seeded_tokens_do_not_depend_on_batch_drafting_or_preemption(llama_dir):
    """A seeded request's tokens depend on its seed, prompt and parameters only. Drafting used
    to consume random numbers, so the same seed gave other tokens in a batch of 6 (where
    `disable_by_batch_size` switched drafting off) than alone."""
    target = PROMPTS[0]
    # A low temperature makes the random model repeat itself, so drafts are proposed.
    params = SamplingParams(temperature=0.3, top_p=0.95, max_tokens=32, ignore_eos=True,
                            seed=123, n=2)
    others = SamplingParams(temperature=0.8, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)

    def tokens(outputs) -> list[list[int]]:
        return [c.token_ids for c in outputs.outputs]

    alone_plain = tokens(LLM(str(llama_dir)).generate([target], params)[0])
    drafting = LLM(str(llama_dir), num_speculative_tokens=K, disable_by_batch_size=4)
    alone_drafting = tokens(drafting.generate([target], params)[0])
    assert drafting.stats()["spec_num_drafts"] > 0
    batch = drafting.generate([target] + PROMPTS[1:6], [params] + [others] * 5)
    assert drafting.stats()["spec_num_disabled_steps"] > 0  # drafting was off in the batch
    preempting = LLM(str(llama_dir), num_speculative_tokens=K, num_blocks=24, block_size=4,
                     enable_prefix_caching=False)
    preempted = preempting.generate([target] + PROMPTS[1:6], [params] + [others] * 5)
    assert preempting.stats()["num_preemptions"] > 0
    assert alone_drafting == alone_plain
    assert tokens(batch[0]) == alone_plain
    assert tokens(preempted[0]) == alone_plain
    assert alone_plain[0] != alone_plain[1]  # the two samples of the prompt differ
