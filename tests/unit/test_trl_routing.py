"""`trainer_bridge.trl_routing`'s layout of the engine's routed experts in TRL's batches: a
rollout's rows (prompt, completion, -1 for the never-read last token), TRL's left-padded prompts
beside right-padded completions with -1 on padding, and the agreement diagnostic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout_engine.protocol import CompletionOutput, RequestOutput, RoutedExperts
from tests.unit.test_routing_replay import input_ids, own_routing, tiny_model
from trainer_bridge.trl_routing import (
    check_routing_replay,
    outputs_routing,
    padded_routing,
    rollout_routing,
)

LAYERS, TOP_K = 2, 2


def rows(start: int, num_tokens: int) -> np.ndarray:
    """[num_tokens, LAYERS, TOP_K] whose token t holds start + t everywhere."""
    values = np.arange(start, start + num_tokens, dtype=np.int16)
    return np.broadcast_to(values[:, None, None], (num_tokens, LAYERS, TOP_K)).copy()


def test_a_rollout_is_its_prompt_then_its_completion_then_minus_one():
    routing = rollout_routing(RoutedExperts.of(rows(0, 3)), RoutedExperts.of(rows(3, 4)))
    assert routing.dtype == np.int16 and routing.shape == (8, LAYERS, TOP_K)
    assert (routing[:7] == rows(0, 7)).all() and (routing[7] == -1).all()
    # Every output token's row given: nothing to fill.
    assert (rollout_routing(rows(0, 3), rows(3, 4), num_completion_tokens=4) == rows(0, 7)).all()
    one_token = rollout_routing(rows(0, 3), None, num_completion_tokens=1)
    assert one_token.shape == (4, LAYERS, TOP_K) and (one_token[3] == -1).all()
    for num_tokens in (3, 6):
        with pytest.raises(ValueError, match="routing rows for"):
            rollout_routing(rows(0, 3), rows(3, 4), num_completion_tokens=num_tokens)
    with pytest.raises(ValueError, match="the completion's"):
        rollout_routing(rows(0, 3), rows(3, 4)[:, :1])


def test_trls_layout_left_pads_prompts_and_right_pads_completions():
    routings = [rows(10, 3 + 2), rows(20, 1 + 4)]
    batch = padded_routing(routings, [3, 1])
    assert batch.dtype == torch.int16 and batch.shape == (2, 3 + 4, LAYERS, TOP_K)
    tokens = batch[:, :, 0, 0].tolist()  # one value per token suffices: rows are uniform
    assert tokens == [[10, 11, 12, 13, 14, -1, -1],
                      [-1, -1, 20, 21, 22, 23, 24]]
    wider = padded_routing(routings, [3, 1], prompt_width=4, completion_width=8)  # multiples
    assert wider[:, :, 0, 0].tolist() == [[-1, 10, 11, 12, 13, 14] + [-1] * 6,
                                          [-1, -1, -1, 20, 21, 22, 23, 24] + [-1] * 4]
    with pytest.raises(ValueError, match="do not fit"):
        padded_routing(routings, [3, 1], prompt_width=2)
    with pytest.raises(ValueError, match="rollout 1"):
        padded_routing([rows(0, 4), rows(0, 4)[:, :, :1]], [2, 2])


def test_engine_outputs_become_one_row_per_completion():
    def completion(index: int, num_tokens: int, start: int) -> CompletionOutput:
        return CompletionOutput(index, list(range(num_tokens)), [0.0] * num_tokens,
                                routed_experts=RoutedExperts.of(rows(start, num_tokens - 1)))

    outputs = [RequestOutput("0", [1, 2], [completion(0, 3, 2), completion(1, 2, 5)],
                             prompt_routed_experts=RoutedExperts.of(rows(0, 2))),
               RequestOutput("1", [7], [completion(0, 1, 1)],
                             prompt_routed_experts=RoutedExperts.of(rows(0, 1)))]
    batch = outputs_routing(outputs, prompt_width=2, completion_width=3)
    assert batch[:, :, 0, 0].tolist() == [[0, 1, 2, 3, -1],
                                          [0, 1, 5, -1, -1],
                                          [-1, 0, -1, -1, -1]]
    outputs[1].prompt_routed_experts = None
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        outputs_routing(outputs, prompt_width=2, completion_width=3)


def test_the_diagnostic_counts_agreeing_known_attended_positions():
    model = tiny_model("qwen3_moe")
    ids = input_ids(model, batch=2, length=6)
    mask = torch.ones_like(ids)
    own, _ = own_routing(model, ids)
    assert check_routing_replay(model, ids, mask, own.flip(-1)) == 1.0  # sets, not order
    other = own.clone()
    other[:3] = (own[:3] + 1) % 4  # 3 of 12 tokens elsewhere in both layers
    assert check_routing_replay(model, ids, mask, other) == 0.75
    other[:3] = -1  # not replayed there: not counted
    assert check_routing_replay(model, ids, mask, other) == 1.0
    mask[0, :3] = 0  # padding is not counted either
    own, _ = own_routing(model, ids, mask)
    padding = ~mask.reshape(-1).bool()
    other = own.clone()
    other[padding] = (own[padding] + 1) % 4
    assert check_routing_replay(model, ids, mask, other) == 1.0
