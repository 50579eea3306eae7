"""Routing replay in TRL's GRPOTrainer: the engine's routed experts laid out as TRL's batches.

`EngineGRPOTrainer(..., routing_replay=True)` against an engine serving with
`--enable-return-routed-experts` keeps each rollout's experts (`RequestOutput.
prompt_routed_experts`, `CompletionOutput.routed_experts`) and replays them into every forward
TRL runs on those completions: the old-logprob and reference forwards right after generation,
and the loss forward (its activation-checkpointed recompute included). TRL's batch is
`prompt_ids` left-padded beside `completion_ids` right-padded; `padded_routing` lays the
routing out the same way, -1 on padding (and on each completion's last token, which the engine
never read and whose logits TRL drops): those rows keep the model's own routing. The routing
travels in the batch dict (`"routed_experts"`, [batch, tokens, MoE layers, top_k] int16), so
TRL's shuffling and splitting into steps carries it along.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from rollout_engine.protocol import RequestOutput
from trainer_bridge.routing_replay import replayable_routers, routing_tensor

ROUTING_KEY = "routed_experts"
"""The batch-dict key of a generation batch's routing."""


def rollout_routing(prompt_routed: Any, completion_routed: Any,
                    num_completion_tokens: int | None = None) -> np.ndarray:
    """One rollout's routing, [prompt + completion tokens, MoE layers, top_k] int16: the
    prompt's rows, the completion's, and -1 for the completion tokens the engine never read
    (its last; `num_completion_tokens` None: exactly that one)."""
    prompt = _array(prompt_routed)
    completion = (np.zeros((0, *prompt.shape[1:]), np.int16) if completion_routed is None
                  else _array(completion_routed))
    if completion.shape[1:] != prompt.shape[1:]:
        raise ValueError(f"prompt routing is [tokens, {prompt.shape[1:]}], the completion's "
                         f"[tokens, {completion.shape[1:]}]")
    if num_completion_tokens is None:
        num_completion_tokens = len(completion) + 1
    num_missing = num_completion_tokens - len(completion)
    if not 0 <= num_missing <= 1:
        raise ValueError(f"{len(completion)} routing rows for {num_completion_tokens} completion "
                         "tokens: the engine returns every token's but the last's")
    missing = np.full((num_missing, *prompt.shape[1:]), -1, np.int16)
    return np.concatenate([prompt, completion, missing])


def _array(routed: Any) -> np.ndarray:
    array = np.asarray(routed.to_numpy() if hasattr(routed, "to_numpy") else routed)
    if array.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, MoE layers, top_k], got {array.shape}")
    return array.astype(np.int16, copy=False)


def padded_routing(routings: Sequence[np.ndarray], prompt_lengths: Sequence[int],
                   prompt_width: int | None = None,
                   completion_width: int | None = None) -> torch.Tensor:
    """TRL's batch layout of `rollout_routing`s: [batch, prompt_width + completion_width, MoE
    layers, top_k] int16, each prompt's rows right-aligned in the first `prompt_width` columns
    (left padding), its completion's from column `prompt_width` on (right padding), -1
    elsewhere. Widths default to the longest prompt and completion."""
    if len(routings) != len(prompt_lengths) or not routings:
        raise ValueError(f"{len(routings)} routings for {len(prompt_lengths)} prompt lengths")
    completion_lengths = [len(r) - p for r, p in zip(routings, prompt_lengths)]
    prompt_width = max(prompt_lengths) if prompt_width is None else prompt_width
    completion_width = (max(completion_lengths) if completion_width is None
                        else completion_width)
    if max(prompt_lengths) > prompt_width or max(completion_lengths) > completion_width:
        raise ValueError(f"rollouts of up to {max(prompt_lengths)} prompt and "
                         f"{max(completion_lengths)} completion tokens do not fit a batch of "
                         f"{prompt_width} + {completion_width} columns")
    shape = routings[0].shape[1:]
    batch = np.full((len(routings), prompt_width + completion_width, *shape), -1, np.int16)
    for row, (routing, prompt_length) in enumerate(zip(routings, prompt_lengths)):
        if routing.shape[1:] != shape:
            raise ValueError(f"rollout {row} has routing [tokens, {routing.shape[1:]}], "
                             f"rollout 0 [tokens, {shape}]")
        batch[row, prompt_width - prompt_length:prompt_width] = routing[:prompt_length]
        batch[row, prompt_width:prompt_width + len(routing) - prompt_length] = (
            routing[prompt_length:])
    return torch.from_numpy(batch)


def outputs_routing(outputs: Sequence[RequestOutput], prompt_width: int,
                    completion_width: int) -> torch.Tensor:
    """`padded_routing` of every completion of `outputs`, in order (one batch row each)."""
    routings, prompt_lengths = [], []
    for output in outputs:
        if output.prompt_routed_experts is None:
            raise ValueError("the engine returned no routed experts: serve it with "
                             "--enable-return-routed-experts")
        for completion in output.outputs:
            routings.append(rollout_routing(output.prompt_routed_experts,
                                            completion.routed_experts, len(completion.token_ids)))
            prompt_lengths.append(len(output.prompt_token_ids))
    return padded_routing(routings, prompt_lengths, prompt_width, completion_width)


@torch.no_grad()
def check_routing_replay(model: nn.Module, input_ids: torch.Tensor,
                         attention_mask: torch.Tensor, routed_experts: Any,
                         **forward_kwargs: Any) -> float:
    """A diagnostic: the fraction of (token, MoE layer) positions, among those with a replayed
    routing (not -1) and attended (`attention_mask`), where the model's own forward (as given,
    no replay) picks the replayed experts (as sets). 1.0: replay changes nothing here."""
    routers = replayable_routers(model)
    seen: list[torch.Tensor | None] = [None] * len(routers)
    hooks = [router.register_forward_hook(
        lambda module, args, out, layer=layer: seen.__setitem__(layer, out[-1]))
        for layer, router in enumerate(routers)]
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    own = torch.stack(seen, 1).cpu()  # [tokens, MoE layers, top_k]
    routed = routing_tensor(routed_experts).cpu().reshape(own.shape).to(own.dtype)
    known = (routed >= 0).all(-1) & attention_mask.reshape(-1, 1).bool().cpu()
    same = (own.sort(-1).values == routed.sort(-1).values).all(-1)
    return float((same & known).sum() / known.sum()) if known.any() else 1.0


def engine_returns_routed_experts(client: Any) -> bool:
    """Whether the engine behind `client` serves with `--enable-return-routed-experts`."""
    config = json.loads(client.info().config_json)
    return bool(config.get("model_config", {}).get("enable_return_routed_experts", False))


class RoutingReplay:
    """GRPOTrainer mixin: with `self.routing_replay` set, every logprob and loss forward of a
    generation batch replays the experts the engine routed it to (see the module doc)."""

    routing_replay: bool = False
    _batch_routing: torch.Tensor | _RolloutRouting | None = None

    def check_routing_replay_setup(self, client: Any) -> None:
        """Refuse, with the fix, what routing replay cannot serve."""
        if not self.routing_replay:
            return
        if not engine_returns_routed_experts(client):
            raise ValueError("routing_replay=True needs an engine serving with "
                             "--enable-return-routed-experts (LLM(..., "
                             "enable_return_routed_experts=True)); this one is not")
        if self.tools or self.rollout_func is not None:
            raise ValueError("routing_replay=True replays single-turn rollouts; with tools or a "
                             "rollout_func TRL builds completions the engine did not route")
        for model in (self.model, self.ref_model):
            if model is not None:
                replayable_routers(self.accelerator.unwrap_model(model))

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        if not self.routing_replay:
            return super()._generate_and_score_completions(inputs)
        self._batch_routing = _RolloutRouting(self.vllm_generation)
        try:
            output = super()._generate_and_score_completions(inputs)
            routing = self._batch_routing.padded(output["prompt_ids"].size(1),
                                                 output["completion_ids"].size(1))
        finally:
            self._batch_routing = None
        output[ROUTING_KEY] = routing.to(output["prompt_ids"].device)
        return output

    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if not self.routing_replay:
            return super()._compute_loss(model, inputs)
        self._batch_routing = inputs[ROUTING_KEY]
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._batch_routing = None

    def batch_routing(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        routing = self._batch_routing
        if routing is None:
            return super().batch_routing(input_ids, logits_to_keep)
        if isinstance(routing, _RolloutRouting):
            routing = routing.padded(input_ids.size(1) - logits_to_keep, logits_to_keep)
        if routing.shape[:2] != input_ids.shape:
            raise ValueError(f"the batch's routing is {tuple(routing.shape[:2])} tokens, its "
                             f"input_ids {tuple(input_ids.shape)}")
        return routing


class _RolloutRouting:
    """The last rollout's routing, laid out once TRL's batch widths are known."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._padded: dict[tuple[int, int], torch.Tensor] = {}

    def padded(self, prompt_width: int, completion_width: int) -> torch.Tensor:
        key = (prompt_width, completion_width)
        if key not in self._padded:
            self._padded[key] = outputs_routing(self.backend.last_outputs, *key)
        return self._padded[key]
