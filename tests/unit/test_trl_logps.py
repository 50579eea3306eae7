"""TRL's logprob forward renormalised over sampling supports (`trl_logps`, `invariant_logps`):
the supports laid out as TRL's batch, each row's logprobs equal to `masked_logprobs` of the same
logits, rows without a support over the whole vocabulary, and a token outside its support
refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from rollout_engine.protocol import CompletionOutput, RequestOutput, SamplingMask
from trainer_bridge.invariant_logps import per_token_logps_and_entropies
from trainer_bridge.masked_logprobs import masked_logprobs
from trainer_bridge.trl_logps import outputs_supports

VOCAB = 64


def completion(token_ids: list[int], supports: list[list[int]]) -> CompletionOutput:
    return CompletionOutput(index=0, token_ids=token_ids, logprobs=[0.0] * len(token_ids),
                            sampling_mask=SamplingMask.of(supports))


def test_supports_are_laid_out_one_row_per_completion():
    outputs = [RequestOutput("a", [1, 2], [completion([5, 6], [[5, 9], [6]]),
                                           completion([7], [[7, 8, 3]])])]
    supports = outputs_supports(outputs, completion_width=3)
    assert supports.tolist() == [[[5, 9, -1], [6, -1, -1], [-1, -1, -1]],
                                 [[7, 8, 3], [-1, -1, -1], [-1, -1, -1]]]


@torch.no_grad()
def test_logprobs_over_supports_equal_masked_logprobs():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).eval()
    input_ids = torch.randint(0, VOCAB, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    num_completion, temperature = 3, 0.7
    completion_ids = input_ids[:, -num_completion:]
    supports = torch.full((2, num_completion, 4), -1, dtype=torch.int32)
    lists = [[[0, int(completion_ids[0, 0])], [int(completion_ids[0, 1]), 11, 12, 13], []],
             [[int(completion_ids[1, 0])], [], [int(completion_ids[1, 2]), 0]]]
    for row, positions in enumerate(lists):
        for position, ids in enumerate(positions):
            supports[row, position, :len(ids)] = torch.tensor(ids)
    logps, entropies, _ = per_token_logps_and_entropies(
        model, input_ids, attention_mask, num_completion, temperature, compute_entropy=True,
        invariant=False, supports=supports)
    plain, _, _ = per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                num_completion, temperature, invariant=False)
    logits = model(input_ids).logits[:, -num_completion - 1:-1]
    for row, positions in enumerate(lists):
        for position, ids in enumerate(positions):
            if not ids:  # no support: the whole vocabulary
                assert logps[row, position] == plain[row, position]
                continue
            support = torch.zeros(1, VOCAB, dtype=torch.bool)
            support[0, ids] = True
            expected = masked_logprobs(logits[row, position:position + 1],
                                       completion_ids[row, position:position + 1], support,
                                       temperature=temperature)
            torch.testing.assert_close(logps[row, position], expected[0], atol=1e-5, rtol=0)
    assert torch.isfinite(entropies).all()
    assert entropies[1, 0] == 0  # a support of one token
    supports[0, 0, :2] = torch.tensor([1, 2]) if int(completion_ids[0, 0]) > 2 else 40
    with pytest.raises(ValueError, match="outside its sampling mask"):
        per_token_logps_and_entropies(model, input_ids, attention_mask, num_completion,
                                      temperature, invariant=False, supports=supports)
