"""Routing replay on CUDA: the CPU engine's experts (a numpy array on the host) replayed into a
Qwen3-MoE on the GPU give its own forward where they are its own (a host index would not
gather from device logits), and hold through an activation-checkpointed backward."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_routing_replay import gradients, input_ids, own_routing, tiny_model
from trainer_bridge.routing_replay import replay_routing

pytestmark = pytest.mark.gpu


def test_host_routing_replays_into_a_cuda_model():
    model = tiny_model("qwen3_moe").cuda()
    ids = input_ids(model).cuda()
    routed, logits = own_routing(model, ids)
    host = routed.cpu().numpy().astype("int16")
    host[::4] = -1
    with torch.no_grad(), replay_routing(model, host):
        torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=1e-5)
    routing = (routed.cpu() + 1) % 4
    expected = gradients(model, ids, routing, None)
    got = gradients(model, ids, routing, {"use_reentrant": False})
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
