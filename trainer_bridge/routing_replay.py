"""Routing replay (R3) in the trainer: a Hugging Face MoE model's forward forced to the experts
the engine routed each token to (`CompletionOutput.routed_experts`), so that a token's logprob
is computed by the experts that sampled it even where a tiny logit difference would flip the
router's top-k.

    routing = np.concatenate([output.prompt_routed_experts.to_numpy(),
                              completion.routed_experts.to_numpy()])
    with replay_routing(model, routing):       # rows: the forward's tokens, in order
        logits = model(torch.tensor([prompt + completion.token_ids[:-1]])).logits

Each router (transformers' `*TopKRouter`) still computes its logits; its top-k indices are
replaced by the given ones and their weights are computed from the router's logits at those
experts as the router weighs its own top-k (`replayable_routers` lists the routers whose
weighting is known; others, e.g. DeepSeek's sigmoid scores with a bias, are refused rather than
replayed wrong). A row of -1 (a padding position, the never-read last token) keeps the router's
own choice. The forced routing holds for activation checkpointing too: a checkpointed layer's
recompute in the backward replays the experts its forward replayed, even after the block ends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from rollout_engine.worker.routed_experts import routers_of

# How each router family weighs its top-k (checked against transformers' forwards; the
# replayed weights of the router's own experts are its own, bit for bit: tests/unit).
_SOFTMAX_THEN_TOP_K = {  # softmax over every expert, the top-k's probabilities (renormalised?)
    **dict.fromkeys(("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter",
                     "OlmoeTopKRouter", "FlexOlmoTopKRouter", "MellumTopKRouter",
                     "LaraMiniTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter",
                     "Qwen3OmniMoeTalkerTextTopKRouter"), "norm_topk_prob"),
    **dict.fromkeys(("MixtralTopKRouter", "MiniMaxTopKRouter", "Qwen3_5MoeTopKRouter",
                     "Qwen3VLMoeTextTopKRouter", "Qwen3OmniMoeTextTopKRouter"), True),
    "JambaTopKRouter": False,
}
_TOP_K_THEN_SOFTMAX = {  # softmax over the top-k's logits
    "GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter", "GraniteMoeHybridTopKRouter",
    "GraniteMoeSWATopKRouter", "GptOssTopKRouter", "AriaTextTopKRouter",
}
_MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def replayable_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model` that routing replay forces, in layer order (the engine's
    `routed_experts` layer order). Raises NotImplementedError, naming them, for MoE routers
    whose weighting is not known here, and ValueError for a model without MoE layers."""
    routers = routers_of(model)
    unsupported = sorted({type(r).__name__ for r in routers if _weigh_of(r) is None})
    if unsupported:
        raise NotImplementedError(
            f"routing replay does not support {', '.join(unsupported)}: only routers that pick "
            "the top-k of a softmax (Qwen2/3-MoE, OLMoE, Mixtral, ...) or softmax their top-k "
            "logits (GraniteMoE, GPT-OSS) are replayed; sigmoid-scored routers with a bias "
            "(DeepSeek-style) are not")
    if routers:
        return routers
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) for key in _MOE_CONFIG_KEYS):
        raise NotImplementedError(
            f"routing replay does not support {getattr(config, 'model_type', type(model))}: "
            "its MoE routers are not transformers' *TopKRouter modules")
    raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to replay")


@contextlib.contextmanager
def replay_routing(model: nn.Module, routed_experts: Any) -> Iterator[None]:
    """Within the block, `model`'s routers take their experts from `routed_experts`: [tokens,
    MoE layers, top_k] (one row per token the routers see, batch-major) or [batch, tokens,
    MoE layers, top_k]; a numpy array, a tensor or a `RoutedExperts`. A (token, layer) row of
    -1 keeps the router's own top-k there."""
    replay = _Replay(replayable_routers(model), routed_experts)
    checkpointing = _CheckpointReplay(model, replay)
    try:
        with replay.forcing():
            yield
    finally:
        checkpointing.remove()


class _Replay:
    """One forward's forced routing: per router, its experts on the router's device."""

    def __init__(self, routers: list[nn.Module], routed_experts: Any) -> None:
        self.routers = routers
        routed = routing_tensor(routed_experts)
        if routed.dim() == 4:
            routed = routed.flatten(0, 1)
        if routed.dim() != 3 or routed.shape[1] != len(routers):
            raise ValueError(f"routed_experts must be [tokens, {len(routers)} MoE layers, top_k]"
                             f" or [batch, tokens, {len(routers)}, top_k], got "
                             f"{tuple(routed.shape)}")
        _check_rows(routed, routers)
        self.forwards = [_ForcedForward(router, routed[:, layer], self)
                         for layer, router in enumerate(routers)]

    @contextlib.contextmanager
    def forcing(self) -> Iterator[None]:
        """Routers forced to this replay (a no-op where they already are: nested calls)."""
        previous = [router.__dict__.get("forward") for router in self.routers]
        try:
            for router, forced, before in zip(self.routers, self.forwards, previous):
                if not (isinstance(before, _ForcedForward) and before.replay is self):
                    router.forward = forced
            yield
        finally:
            for router, before in zip(self.routers, previous):
                if before is None:
                    router.__dict__.pop("forward", None)
                else:
                    router.forward = before


def routing_tensor(routed_experts: Any) -> torch.Tensor:
    """A routing (numpy array, tensor or `RoutedExperts`) as an int64 tensor, where it was."""
    if hasattr(routed_experts, "to_numpy"):
        routed_experts = routed_experts.to_numpy()
    if isinstance(routed_experts, torch.Tensor):
        return routed_experts.to(torch.int64)
    return torch.as_tensor(np.asarray(routed_experts), dtype=torch.int64)


def _check_rows(routed: torch.Tensor, routers: list[nn.Module]) -> None:
    """Each (token, layer) row is either all -1 (free) or k expert ids the router has."""
    top_k = int(getattr(routers[0], "top_k", routed.shape[-1]))
    if routed.shape[-1] != top_k:
        raise ValueError(f"routed_experts has top_k {routed.shape[-1]}, the model's routers "
                         f"pick {top_k}")
    free = routed < 0
    if (free.any(-1) & ~free.all(-1)).any():
        raise ValueError("routed_experts has rows partly -1: a (token, layer) row is either "
                         "all -1 (the model routes it) or all expert ids")
    num_experts = min(_num_experts(router) for router in routers)
    if (routed >= num_experts).any():
        raise ValueError(f"routed_experts names expert {int(routed.max())}; the model has "
                         f"{num_experts} per layer")


def _num_experts(router: nn.Module) -> int:
    return int(getattr(router, "num_experts", 0) or router.weight.shape[0])


class _ForcedForward:
    """A router's forward with its experts replaced by the replayed ones (free rows: its own)."""

    def __init__(self, router: nn.Module, experts: torch.Tensor, replay: _Replay) -> None:
        before = router.__dict__.get("forward")
        self.inner = before.inner if isinstance(before, _ForcedForward) else (
            before or type(router).forward.__get__(router))
        self.weigh = _weigh_of(router)
        self.replay = replay
        device = next(router.parameters()).device
        self.experts = experts.to(device)  # [tokens, top_k]
        free = (self.experts < 0).all(-1)
        self.free = free[:, None] if free.any() else None  # [tokens, 1]
        if self.free is not None:  # gather needs valid ids; these rows take the router's own
            self.experts = self.experts.clamp(min=0)

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        router_logits, own_weights, own_experts = self.inner(hidden_states, *args, **kwargs)
        if router_logits.shape[0] != self.experts.shape[0]:
            raise ValueError(f"the router saw {router_logits.shape[0]} tokens, the replayed "
                             f"routing has {self.experts.shape[0]}")
        weights = self.weigh(router_logits, self.experts).to(own_weights.dtype)
        experts = self.experts.to(own_experts.dtype)
        if self.free is not None:
            weights = torch.where(self.free, own_weights, weights)
            experts = torch.where(self.free, own_experts, experts)
        return router_logits, weights, experts


def _weigh_of(router: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """How `router` weighs the experts it picked: (router_logits [tokens, experts], experts
    [tokens, top_k]) -> weights [tokens, top_k]; None where it is not known here."""
    name = type(router).__name__
    if name in _TOP_K_THEN_SOFTMAX:
        return _softmax_of_top_k
    if name not in _SOFTMAX_THEN_TOP_K:
        return None
    renormalise = _SOFTMAX_THEN_TOP_K[name]
    if renormalise == "norm_topk_prob":
        renormalise = bool(router.norm_topk_prob)
    return functools.partial(_top_k_of_softmax, renormalise=renormalise)


def _top_k_of_softmax(logits: torch.Tensor, experts: torch.Tensor,
                      renormalise: bool) -> torch.Tensor:
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if renormalise:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights


def _softmax_of_top_k(logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.gather(-1, experts), dim=-1)


class _CheckpointReplay:
    """Activation checkpointing recomputes a layer in the backward, often after the replay
    block has ended: while `model` runs a forward, each checkpointed layer's checkpoint
    function is wrapped so that the layer (forward and recompute alike) runs forced to
    `replay`. Wrapped at the forward, not before, so that whatever set the checkpoint function
    last (`invariant_logps.recompute_in_the_mode`) stays inside."""

    def __init__(self, model: nn.Module, replay: _Replay) -> None:
        self.model, self.replay = model, replay
        self.wrapped: list[tuple[nn.Module, Callable]] = []
        self.hooks = [model.register_forward_pre_hook(lambda *_: self.wrap()),
                      model.register_forward_hook(lambda *_: self.unwrap(), always_call=True)]

    def wrap(self) -> None:
        self.unwrap()
        for module in self.model.modules():
            function = getattr(module, "_gradient_checkpointing_func", None)
            if getattr(module, "gradient_checkpointing", False) and function is not None:
                self.wrapped.append((module, function))
                module._gradient_checkpointing_func = functools.partial(
                    _checkpoint_replaying, function, self.replay)

    def unwrap(self) -> None:
        for module, function in self.wrapped:
            module._gradient_checkpointing_func = function
        self.wrapped = []

    def remove(self) -> None:
        self.unwrap()
        for hook in self.hooks:
            hook.remove()


def _checkpoint_replaying(checkpoint: Callable, replay: _Replay, function: Callable,
                          *args: Any, **kwargs: Any) -> Any:
    return checkpoint(functools.partial(_run_replaying, replay, function), *args, **kwargs)


def _run_replaying(replay: _Replay, function: Callable, *args: Any, **kwargs: Any) -> Any:
    with replay.forcing():
        return function(*args, **kwargs)
