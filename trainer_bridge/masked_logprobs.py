"""A trainer's logprobs renormalised over the engine's sampling masks (sampling-mask replay).

With top-k, top-p or min-p, the engine samples each token from the distribution renormalised
over the tokens its truncation kept, and its logprobs are of that distribution; a trainer's
log-softmax over the whole vocabulary gives every token less mass than the engine did, which
biases importance ratios and KL estimates. `SamplingParams(return_sampling_mask=True)` returns
those supports (`CompletionOutput.sampling_mask`); renormalising over them makes both sides
compute the same distribution:

    completion = out.outputs[0]
    logits = model(torch.tensor([out.prompt_token_ids + completion.token_ids])).logits[0]
    logits = logits[len(out.prompt_token_ids) - 1 : -1]  # [T, V]: each predicts its token
    logprobs = masked_logprobs(logits, completion.token_ids, completion.sampling_mask,
                               temperature=params.temperature)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rollout_engine.protocol import GREEDY_EPSILON, SamplingMask


def support_mask(
    mask: SamplingMask, vocab_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """[T, V] bool: row t is True at the ids token t's support holds."""
    ids = torch.from_numpy(mask.to_numpy().astype(np.int64)).to(device)  # [N]
    if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        raise ValueError(f"a sampling mask holds ids outside a vocabulary of {vocab_size}: "
                         f"[{int(ids.min())}, {int(ids.max())}]; pass the model's vocab_size")
    counts = torch.tensor(mask.counts, dtype=torch.int64, device=device)  # [T]
    rows = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)  # [N]
    support = torch.zeros(len(counts), vocab_size, dtype=torch.bool, device=device)
    support[rows, ids] = True
    return support


def masked_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor | Sequence[int],
    mask: SamplingMask | torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """[T] float32: each token's logprob under log_softmax(logits / temperature) renormalised
    over its support (differentiable in `logits`). `logits` [T, V] are those that predicted
    `token_ids` [T]; `mask` is their SamplingMask or a [T, V] bool support (`support_mask`);
    `temperature` the request's. A greedy token's support is itself: its logprob is 0."""
    vocab_size = logits.shape[-1]
    if isinstance(mask, SamplingMask):
        mask = support_mask(mask, vocab_size, logits.device)
    if mask.shape != logits.shape:
        raise ValueError(f"the mask covers {tuple(mask.shape)} (tokens, vocabulary), the logits "
                         f"{tuple(logits.shape)}: pass the logits of exactly the masked tokens")
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device)[:, None]
    if not bool(mask.gather(1, token_ids).all()):
        raise ValueError("a token lies outside its sampling mask: the mask is not this "
                         "completion's, or not aligned with its tokens")
    scaled = logits.float()
    if temperature >= GREEDY_EPSILON and temperature != 1.0:  # greedy: one token, any scale
        scaled = scaled / temperature
    masked = scaled.masked_fill(~mask, float("-inf"))  # [T, V]
    return masked.log_softmax(-1).gather(1, token_ids).squeeze(1)
