"""Routing replay in TRL's batch layout on a Qwen3-MoE: the engine's experts, laid out as TRL's
left-padded prompts beside right-padded completions (`trl_routing.padded_routing`) and replayed
into the trainer's padded forward, give the engine's logprobs (within 1e-5 in float32; bit for
bit with both sides batch-invariant), and the trainer's own routing agrees at every position,
prefix-cache hits and preempted requests included. The control: in bfloat16 the trainer's own
kernels route some positions elsewhere than the engine's, and those carry most of the logprob
gap; replay takes that part away."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_engine import LLM, SamplingParams
from tests.integration.test_routed_experts import moe_dir  # noqa: F401
from tests.unit.test_paged_attention_cpu import require_kernel
from trainer_bridge.invariant_logps import per_token_logps_and_entropies
from trainer_bridge.routing_replay import replay_routing
from trainer_bridge.trl_routing import check_routing_replay, outputs_routing

PROMPTS = [[5, 17, 99, 250, 7, 31, 8, 64, 12], [3, 14, 15, 92, 65, 35], [42, 7]]
PARAMS = [SamplingParams(n=2, max_tokens=n, temperature=1.0, logprobs=0, seed=7, ignore_eos=True)
          for n in (12, 7, 10)]
PAD_ID = 0


@pytest.fixture(scope="module")
def trainer_model(moe_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def trl_batch(outputs) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """TRL's layout of every completion: (input_ids, attention_mask, completion width, the
    sampling logprobs [batch, completion width])."""
    prompts = [o.prompt_token_ids for o in outputs for _ in o.outputs]
    completions = [list(c.token_ids) for o in outputs for c in o.outputs]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.full((len(prompts), width_p + width_c), PAD_ID)
    mask = torch.zeros_like(ids)
    sampled = torch.zeros(len(prompts), width_c)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        span = slice(width_p - len(prompt), width_p + len(completion))
        ids[row, span], mask[row, span] = torch.tensor(prompt + completion), 1
    for row, completion in enumerate(c for o in outputs for c in o.outputs):
        sampled[row, :len(completion.logprobs)] = torch.tensor(completion.logprobs)
    return ids, mask, width_c, sampled


@torch.no_grad()
def trainer_logprobs(model, ids, mask, width_c) -> torch.Tensor:
    """TRL's recipe, with the engine's positions (counted from each row's first token)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    logprobs = torch.log_softmax(logits[:, -width_c - 1:-1].float(), -1)
    return logprobs.gather(-1, ids[:, -width_c:, None])[..., 0]


def gap(trainer: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor, width_c: int):
    return ((trainer - sampled).abs() * mask[:, -width_c:]).max().item()


def engine_runs(moe_dir) -> dict[str, list]:  # noqa: F811
    """The same rollouts computed afresh, from the prefix cache and under preemption."""
    runs = {"fresh": LLM(str(moe_dir), enable_return_routed_experts=True).generate(PROMPTS,
                                                                                   PARAMS)}
    cached = LLM(str(moe_dir), enable_return_routed_experts=True, block_size=4)
    cached.generate(PROMPTS, PARAMS)
    runs["prefix hit"] = cached.generate(PROMPTS, PARAMS)
    assert all(o.num_cached_tokens >= 4 for o in runs["prefix hit"][:2])
    preempting = LLM(str(moe_dir), enable_return_routed_experts=True, num_blocks=8,
                     block_size=4, enable_prefix_caching=False)
    runs["preempted"] = preempting.generate(PROMPTS, PARAMS)
    assert preempting.stats()["num_preemptions"] > 0
    return runs


def test_replayed_logprobs_are_the_engines_and_routing_agrees_everywhere(moe_dir,  # noqa: F811
                                                                        trainer_model):
    for name, outputs in engine_runs(moe_dir).items():
        ids, mask, width_c, sampled = trl_batch(outputs)
        routing = outputs_routing(outputs, ids.size(1) - width_c, width_c)
        assert routing.shape[:2] == ids.shape
        free = (routing < 0).all(-1).all(-1)  # padding and each completion's last token
        assert (free | mask.bool()).all() and (free & mask.bool()).sum() == len(ids)
        assert check_routing_replay(trainer_model, ids, mask, routing,
                                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0)) == 1.0, name
        with replay_routing(trainer_model, routing):
            replayed = trainer_logprobs(trainer_model, ids, mask, width_c)
        assert gap(replayed, sampled, mask, width_c) < 1e-5, name


def test_with_both_sides_batch_invariant_the_bits_are_the_engines(moe_dir):  # noqa: F811
    require_kernel()
    outputs = LLM(str(moe_dir), enable_return_routed_experts=True, batch_invariant=True,
                  max_num_batched_tokens=16).generate(PROMPTS, PARAMS)
    ids, mask, width_c, sampled = trl_batch(outputs)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    with replay_routing(model, outputs_routing(outputs, ids.size(1) - width_c, width_c)):
        logps, _, _ = per_token_logps_and_entropies(model, ids, mask, width_c, 1.0)
    real = mask[:, -width_c:].bool()
    assert torch.equal(logps[real], sampled[real])


def test_the_control_in_bfloat16_the_trainer_routes_elsewhere(moe_dir):  # noqa: F811
    """Engine and trainer in bfloat16 from the same weights: their kernels round differently,
    which flips a router's top-k at a few percent of the positions (97.7% agree on this
    machine), and those positions carry most of the logprob gap (0.24 against 0.016)."""
    outputs = LLM(str(moe_dir), enable_return_routed_experts=True,
                  dtype="bfloat16").generate(PROMPTS, PARAMS)
    ids, mask, width_c, sampled = trl_batch(outputs)
    routing = outputs_routing(outputs, ids.size(1) - width_c, width_c)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert 0.8 < check_routing_replay(model, ids, mask, routing, position_ids=positions) < 1.0
    own = gap(trainer_logprobs(model, ids, mask, width_c), sampled, mask, width_c)
    with replay_routing(model, routing):
        replayed = gap(trainer_logprobs(model, ids, mask, width_c), sampled, mask, width_c)
    assert replayed < own / 5, (own, replayed)
