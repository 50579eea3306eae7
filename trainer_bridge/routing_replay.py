"""Routing replay (R3) in the trainer: a Hugging Face MoE model's forward forced to the experts
the engine routed each token to (`CompletionOutput.routed_experts`), so that a token's logprob
is computed by the experts that sampled it even where a tiny logit difference would flip the
router's top-k.

    routing = np.concatenate([output.prompt_routed_experts.to_numpy(),
                              completion.routed_experts.to_numpy()])
    with replay_routing(model, routing):       # rows: the forward's tokens, in order
        logits = model(torch.tensor([prompt + completion.token_ids[:-1]])).logits

Each router (transformers' `*TopKRouter`) still computes its logits; its top-k indices are
replaced by the given ones and their weights are the router's softmax probabilities at those
experts (renormalised where the router renormalises its top-k: `norm_topk_prob`), as the
routed path computes them. Only routers that say whether they renormalise (Qwen2-MoE, Qwen3-MoE,
OLMoE...) are replayed; others (Mixtral always renormalises, DeepSeek scores by sigmoid with a
bias) are refused rather than replayed wrong.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from rollout_engine.worker.routed_experts import routers_of


@contextlib.contextmanager
def replay_routing(model: nn.Module, routed_experts: np.ndarray | torch.Tensor) -> Iterator[None]:
    """Within the block, `model`'s routers take their experts from `routed_experts`
    ([tokens, MoE layers, top_k]: one row per token the routers see, batch-major)."""
    routers = routers_of(model)
    routed = torch.as_tensor(np.asarray(routed_experts), dtype=torch.int64)
    if routed.dim() != 3 or routed.shape[1] != len(routers):
        raise ValueError(f"routed_experts must be [tokens, {len(routers)} MoE layers, top_k], "
                         f"got {tuple(routed.shape)}")
    if (routed < 0).any():
        raise ValueError("routed_experts has unrecorded positions (-1)")
    for router in routers:
        if not hasattr(router, "norm_topk_prob"):
            raise NotImplementedError(f"routing replay into {type(router).__name__} is not "
                                      "supported (it does not say how it weighs its top-k)")
    originals = [router.forward for router in routers]
    try:
        for layer, router in enumerate(routers):
            router.forward = _forced(router, routed[:, layer])
        yield
    finally:
        for router, forward in zip(routers, originals):
            router.forward = forward


def _forced(router: nn.Module, experts: torch.Tensor):
    routed_forward = router.forward

    def forward(hidden_states: torch.Tensor):
        router_logits, _, _ = routed_forward(hidden_states)
        if router_logits.shape[0] != experts.shape[0]:
            raise ValueError(f"the router saw {router_logits.shape[0]} tokens, the replayed "
                             f"routing has {experts.shape[0]}")
        indices = experts.to(router_logits.device)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        scores = probs.gather(-1, indices)
        if getattr(router, "norm_topk_prob", False):
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return router_logits, scores.to(router_logits.dtype), indices

    return forward
