"""TRL's logprob forwards as the engine computes its logprobs: one override for batch
invariance, routing replay and sampling masks, and the sampling masks laid out as TRL's batch.

`EngineGRPOTrainer` mixes in `EngineLogps`, the one `_get_per_token_logps_and_entropies` of
the trainer: TRL's own (its fused LM head) when none of these is on; else, chunk by chunk, the
chunk's routing replayed (`RoutingReplay.batch_routing`) around either TRL's forward or ours
(`invariant_logps.per_token_logps_and_entropies`, needed for batch invariance and for masks).

With `sampling_masks=True` (`SamplingMasks`), the engine returns each sampled token's support
(`SamplingParams.return_sampling_mask`: the ids top-k, top-p or min-p kept), and every
logprob TRL computes on those completions (old, reference, the loss's) is renormalised over
it, as the engine's sampling logprobs are: the importance-sampling ratio then measures only
what differs between trainer and engine, not the truncation. The supports travel in the batch
dict (`"sampling_supports"`, [batch, completion tokens, max ids] int32, -1 padded), so TRL's
shuffling and splitting carry them along; `top_k` bounds their width (a pure top-p support
on a flat distribution can hold thousands of ids).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from rollout_engine.protocol import CompletionOutput, InternalError, RequestOutput
from trainer_bridge.invariant_logps import per_token_logps_and_entropies
from trainer_bridge.routing_replay import replay_routing

SUPPORTS_KEY = "sampling_supports"
"""The batch-dict key of a generation batch's sampling supports."""


def outputs_supports(outputs: Sequence[RequestOutput], completion_width: int) -> torch.Tensor:
    """[completions, completion_width, max ids] int32: the sampling support of every
    completion token of `outputs`, in order (one batch row per completion), -1 padded."""
    masks = []
    for output in outputs:
        for completion in output.outputs:
            if completion.sampling_mask is None:
                raise ValueError("the engine returned no sampling masks: the requests need "
                                 "return_sampling_mask=True")
            masks.append(completion.sampling_mask)
    max_ids = max((max(m.counts, default=0) for m in masks), default=0)
    supports = torch.full((len(masks), completion_width, max(max_ids, 1)), -1, dtype=torch.int32)
    for row, mask in enumerate(masks):
        counts = np.asarray(mask.counts[:completion_width], dtype=np.int64)  # [positions]
        starts = np.cumsum(counts) - counts  # each position's first id in the flat ids
        positions = np.repeat(np.arange(len(counts)), counts)  # [ids]: the position of each id
        columns = np.arange(len(positions)) - np.repeat(starts, counts)  # [ids]: its column
        ids = mask.to_numpy()[:len(positions)].astype(np.int32)
        supports[row, torch.from_numpy(positions), torch.from_numpy(columns)] = (
            torch.from_numpy(ids))
    return supports


def token_logprobs(completion: CompletionOutput) -> tuple[list[list[float]], list[list[int]]]:
    """TRL's per-token (logprobs, logprob_token_ids) of a completion: the sampled token's
    first (GRPOTrainer reads `[0]` as the sampled token's logprob), then, with
    `SamplingParams.logprobs` set, the other top tokens, most likely first."""
    token_ids, logprobs = completion.token_ids, completion.logprobs
    if completion.top_logprobs is None:
        return [[lp] for lp in logprobs], [[t] for t in token_ids]
    if len(completion.top_logprobs) != len(token_ids):
        raise InternalError(f"the engine returned {len(completion.top_logprobs)} top-logprob "
                            f"entries for {len(token_ids)} tokens")
    rows, id_rows = [], []
    for token, logprob, top in zip(token_ids, logprobs, completion.top_logprobs):
        others = [(t, lp) for t, lp in zip(top.token_ids[1:], top.logprobs[1:]) if t != token]
        rows.append([logprob] + [lp for _, lp in others])
        id_rows.append([token] + [t for t, _ in others])
    return rows, id_rows


class EngineLogps:
    """GRPOTrainer mixin: TRL's logprob and loss forwards with the engine's routing, masks and
    kernels, whichever the trainer asked for (see the module doc)."""

    batch_invariant: bool = False

    def batch_routing(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """The batch's routed experts to replay ([batch, tokens, layers, k]), if any."""
        return None

    def batch_supports(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """The batch's sampling supports ([batch, logits_to_keep, max ids]), if any."""
        return None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **multimodal):
        routing = self.batch_routing(input_ids, logits_to_keep)
        supports = self.batch_supports(input_ids, logits_to_keep)
        own_forward = self.batch_invariant or supports is not None
        if routing is None and not own_forward:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        if any(value is not None for value in multimodal.values()):
            raise ValueError("routing replay, sampling masks and batch-invariant logprobs are "
                             "for text-only models")
        for name, tensor in (("routing", routing), ("sampling supports", supports)):
            if tensor is not None and tensor.size(0) != input_ids.size(0):
                raise ValueError(f"the batch's {name} cover {tensor.size(0)} rows, its input_ids "
                                 f"{input_ids.size(0)}")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies, aux_losses = [], [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            replay = (contextlib.nullcontext() if routing is None
                      else replay_routing(model, routing[rows]))
            # TRL's forwards run under the accelerator's autocast; the invariant kernels do not
            autocast = (contextlib.nullcontext() if self.batch_invariant
                        else self.accelerator.autocast())
            with replay, autocast:
                if own_forward:
                    chunk = per_token_logps_and_entropies(
                        model, input_ids[rows], attention_mask[rows], logits_to_keep,
                        self.temperature, None, compute_entropy, compute_aux_loss,
                        invariant=self.batch_invariant,
                        supports=None if supports is None else supports[rows])
                else:
                    chunk = super()._get_per_token_logps_and_entropies(
                        model, input_ids[rows], attention_mask[rows], logits_to_keep, None,
                        compute_entropy, compute_aux_loss)
            for results, result in zip((logps, entropies, aux_losses), chunk):
                results.append(result)
        return (torch.cat(logps), torch.cat(entropies) if compute_entropy else None,
                torch.stack(aux_losses).mean() if compute_aux_loss else None)


class SamplingMasks:
    """GRPOTrainer mixin: with `self.sampling_masks` set, every logprob of a generation batch
    is renormalised over the supports the engine sampled its tokens from."""

    sampling_masks: bool = False
    _batch_supports: torch.Tensor | Literal["rollout"] | None = None
    """During a generation step "rollout" (the last rollout's masks, laid out when the
    completions' width is known), during a loss the batch's tensor."""

    def check_sampling_masks_setup(self) -> None:
        """Refuse, with the fix, what sampling masks cannot serve; ask the engine for them."""
        if not self.sampling_masks:
            return
        args = self.args
        if not ((args.top_k or 0) > 0 or args.top_p < 1.0 or (args.min_p or 0.0) > 0.0):
            raise ValueError("sampling_masks=True renormalises over what top_k, top_p or min_p "
                             "keep; this GRPOConfig truncates nothing: set one of them")
        if self.tools or self.rollout_func is not None:
            raise ValueError("sampling_masks=True covers single-turn rollouts; with tools or a "
                             "rollout_func TRL builds completions the engine did not mask")
        self.vllm_generation.return_sampling_mask = True

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        if not self.sampling_masks:
            return super()._generate_and_score_completions(inputs)
        self._batch_supports = "rollout"
        try:
            output = super()._generate_and_score_completions(inputs)
            width = output["completion_ids"].size(1)
            supports = self._batch_supports  # laid out already if TRL computed old logprobs
            if not (isinstance(supports, torch.Tensor) and supports.size(1) == width):
                supports = outputs_supports(self.vllm_generation.last_outputs, width)
        finally:
            self._batch_supports = None
        output[SUPPORTS_KEY] = supports.to(output["completion_ids"].device)
        return output

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if not self.sampling_masks:
            return super()._compute_loss(model, inputs)
        self._batch_supports = inputs[SUPPORTS_KEY]
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._batch_supports = None

    def batch_supports(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        supports = self._batch_supports
        if supports is None:
            return super().batch_supports(input_ids, logits_to_keep)
        if isinstance(supports, str):  # the rollout's outputs, not laid out yet
            supports = outputs_supports(self.vllm_generation.last_outputs, logits_to_keep)
            self._batch_supports = supports
        return supports.to(input_ids.device)
