"""The trainer's logprobs as the engine computes them: bit for bit in batch-invariant mode, and
renormalised over the engine's sampling supports when given (`trl_logps.SamplingMasks`).

With `EngineGRPOTrainer(..., batch_invariant=True)` against an engine serving with
`--batch-invariant`, TRL's logprob and loss forwards run here instead of its fused LM head:
one forward of prompt + completion under `set_batch_invariant_mode()`, with positions counted
from each row's first real token (the engine's positions: TRL's own forward numbers left
padding too, which shifts RoPE angles), then logits / temperature and log-softmax in float32,
as the engine computes its processed logprobs. The same tokens then get the same bits on both
sides: TRL's importance-sampling ratio is exactly 1 and its logprob difference exactly 0.

Activation checkpointing recomputes each layer in the backward, outside the forward's mode:
`recompute_in_the_mode` makes the checkpointed layers recompute with the kernels that ran them.

The forward runs in the model's own dtype (no autocast: the kernels do not follow it); load
the model in bfloat16 to train in bfloat16, and serve the engine in the same dtype.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

import torch
import torch.utils.checkpoint

from rollout_engine.batch_invariant import checkpoint_contexts, set_batch_invariant_mode


def engine_runs_batch_invariant(client: Any) -> bool:
    """Whether the engine behind `client` serves with `--batch-invariant`."""
    config = json.loads(client.info().config_json)
    return bool(config.get("model_config", {}).get("batch_invariant", False))


def check_batch_invariance(trainer_invariant: bool, client: Any, args: Any) -> None:
    """Refuse to mix modes: either side alone gives logprobs that are only close."""
    engine_invariant = engine_runs_batch_invariant(client)
    if trainer_invariant and not engine_invariant:
        raise ValueError("batch_invariant=True needs an engine serving with --batch-invariant "
                         "(LLM(..., batch_invariant=True)); this one is not")
    if engine_invariant and not trainer_invariant:
        raise ValueError("the engine serves with --batch-invariant: pass batch_invariant=True "
                         "so that the trainer's logprobs use the same kernels")
    if trainer_invariant and (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        raise ValueError("batch-invariant training computes in the model's dtype, not under "
                         "autocast: set bf16=False / fp16=False and load the model in the "
                         "engine's dtype")


def per_token_logps_and_entropies(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    *,
    invariant: bool = True,
    supports: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """TRL's `_get_per_token_logps_and_entropies` contract (logprobs of the last
    `logits_to_keep` tokens, entropies, the MoE load-balancing loss), computed as the engine
    computes its logprobs: in batch-invariant mode (`invariant`), and renormalised over each
    token's sampling support when `supports` ([batch, logits_to_keep, max ids] int, -1 padded;
    a row of -1: the whole vocabulary) is given."""
    batch_size = batch_size or input_ids.size(0)
    if invariant:
        recompute_in_the_mode(model)  # TRL switches checkpointing off and on around generation
    logps, entropies, aux_losses = [], [], []
    with set_batch_invariant_mode() if invariant else contextlib.nullcontext():
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            mask = attention_mask[start:start + batch_size]
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            outputs = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            use_cache=False, **extra)
            logits = outputs.logits[:, -logits_to_keep - 1:-1].float() / temperature
            if supports is not None:
                logits = _masked_to_support(logits, supports[start:start + batch_size],
                                            ids[:, -logits_to_keep:])
            log_probs = torch.log_softmax(logits, -1)
            logps.append(log_probs.gather(-1, ids[:, -logits_to_keep:, None])[..., 0])
            if compute_entropy:
                entropies.append(-(log_probs.exp() * log_probs.clamp(min=-1e30)).sum(-1))
            if compute_aux_loss:
                aux_losses.append(outputs.aux_loss)
    return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None)


def _masked_to_support(logits: torch.Tensor, supports: torch.Tensor,
                       token_ids: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V] with -inf outside each position's support ([B, T, K] ids, -1 padded;
    positions with no support keep every logit)."""
    has_support = supports[..., 0] >= 0  # [B, T]
    inside = (supports == token_ids[..., None]).any(-1)
    if not bool((inside | ~has_support).all()):
        raise ValueError("a completion token lies outside its sampling mask: the masks are not "
                         "this batch's, or not aligned with its tokens")
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(-1, supports.clamp(min=0).long(), True)  # padding marks id 0: fixed below
    keep[..., 0] &= (supports == 0).any(-1) | ~has_support
    keep |= ~has_support[..., None]
    return logits.masked_fill(~keep, float("-inf"))


_RECOMPUTE = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
                               context_fn=checkpoint_contexts)


def recompute_in_the_mode(model: torch.nn.Module) -> None:
    """Every layer that activation checkpointing wraps (transformers sets
    `_gradient_checkpointing_func` each time it is switched on) recomputes in the mode its
    forward ran in."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and getattr(
                module, "_gradient_checkpointing_func", None) not in (None, _RECOMPUTE):
            module._gradient_checkpointing_func = _RECOMPUTE
