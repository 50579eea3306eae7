"""`trainer_bridge.routing_replay` on tiny random MoE models of each replayable router family:
replaying a model's own routing is its own forward bit for bit (so each family's weighting is
the router's), -1 rows keep the router's choice, another routing changes the output; activation
checkpointing recomputes with the replayed experts after the block has ended (the gradients are
those without checkpointing, bit for bit; without the replayed recompute the checkpoint fails);
unsupported routers and malformed routings are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.test_transformers_backend import CONFIGS, make_config
from trainer_bridge import routing_replay
from trainer_bridge.routing_replay import replay_routing, replayable_routers

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "granitemoe"]


def tiny_model(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(*CONFIGS[family]), dtype=dtype).eval()


def input_ids(model, batch: int = 2, length: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(10, model.config.vocab_size, (batch, length), generator=generator)


def own_routing(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own experts [tokens, MoE layers, top_k] and its logits."""
    routers = replayable_routers(model)
    seen = [None] * len(routers)
    hooks = [router.register_forward_hook(
        lambda module, args, out, layer=layer: seen.__setitem__(layer, out[-1]))
        for layer, router in enumerate(routers)]
    with torch.no_grad():
        logits = model(ids, attention_mask=attention_mask).logits
    for hook in hooks:
        hook.remove()
    return torch.stack(seen, 1), logits


@pytest.mark.parametrize(("family", "dtype"), [(f, torch.float32) for f in FAMILIES]
                         + [("qwen3_moe", torch.bfloat16), ("mixtral", torch.bfloat16)],
                         ids=lambda value: str(value).removeprefix("torch."))
def test_replaying_the_own_routing_is_the_own_forward(family, dtype):
    model = tiny_model(family, dtype)
    ids = input_ids(model)
    routed, logits = own_routing(model, ids)
    partly_free = routed.clone()
    partly_free[::3] = -1  # every third token's rows: the router's own choice
    partly_free[1::3, 0] = -1  # and the first layer of others
    for routing in (routed, routed.numpy().astype("int16"), routed.reshape(2, 12, *routed.shape[1:]),
                    partly_free, torch.full_like(routed, -1)):
        with torch.no_grad(), replay_routing(model, routing):
            assert torch.equal(model(ids).logits, logits)
    num_experts = replayable_routers(model)[0].num_experts
    with torch.no_grad(), replay_routing(model, (routed + 1) % num_experts):
        assert (model(ids).logits - logits).abs().max() > 1e-2
    assert all("forward" not in router.__dict__ for router in replayable_routers(model))


def test_unsupported_models_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="PhimoeTopKRouter"):
        replayable_routers(tiny_model("phimoe"))
    with pytest.raises(NotImplementedError, match="deepseek_v3"):
        replayable_routers(tiny_model("deepseek_v3"))
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        replayable_routers(tiny_model("llama"))


def test_malformed_routings_are_refused():
    model = tiny_model("qwen3_moe")
    ids = input_ids(model)
    routed, _ = own_routing(model, ids)
    partial = routed.clone()
    partial[0, 0, 0] = -1
    cases = {"partly -1": partial, "MoE layers": routed[:, :1], "top_k": routed[..., :1],
             "names expert": routed + 4}
    for message, routing in cases.items():
        with pytest.raises(ValueError, match=message), replay_routing(model, routing):
            pass
    with (pytest.raises(ValueError, match="the router saw 24 tokens"), torch.no_grad(),
          replay_routing(model, routed[:20])):
        model(ids)


def gradients(model, ids: torch.Tensor, routing: torch.Tensor, checkpointing: dict | None):
    model.train().zero_grad()
    if checkpointing is None:
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(checkpointing)
    with replay_routing(model, routing):
        loss = model(ids).logits.logsumexp(-1).mean()
    loss.backward()  # after the block: a checkpointed layer recomputes here
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_replayed_experts(use_reentrant):
    model = tiny_model("qwen3_moe")
    ids = input_ids(model)
    routed, _ = own_routing(model, ids)
    routing = (routed + 1) % 4  # not the model's own: a recompute on its own would differ
    routing[5] = -1
    expected = gradients(model, ids, routing, None)
    got = gradients(model, ids, routing, {"use_reentrant": use_reentrant})
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_without_the_replayed_recompute_checkpointing_fails(monkeypatch):
    """The control: the recompute routed by the model itself saves other tensors."""
    model = tiny_model("qwen3_moe")
    ids = input_ids(model)
    routed, _ = own_routing(model, ids)
    monkeypatch.setattr(routing_replay._CheckpointReplay, "wrap", lambda self: None)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        gradients(model, ids, (routed + 1) % 4, {"use_reentrant": False})
