"""Which Hugging Face RMSNorm modules the transformers backend runs on the fused CPU op: those
whose own forward the op reproduces (Llama's formula), never one that computes something else
(Gemma's 1 + weight), and the model's outputs stay its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

from kernels import cpu_extension
from rollout_engine.batch_invariant import set_batch_invariant_mode
from rollout_engine.worker.models.fused_norms import fuse_rms_norms

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


@pytest.fixture(autouse=True)
def kernel() -> None:
    if not cpu_extension.available():
        pytest.skip("no compiled CPU kernels: nothing is fused")


def built(model_class, config_class, dtype: torch.dtype):
    torch.manual_seed(0)
    model = model_class(config_class(**SHAPE)).to(dtype).eval()
    with torch.no_grad():  # norms of weight 1 would hide a formula that ignores the weight
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llamas_norms_run_fused_and_the_logits_stay(dtype):
    model = built(LlamaForCausalLM, LlamaConfig, dtype)
    input_ids = torch.randint(0, 128, (1, 24))
    with torch.inference_mode():
        expected = model(input_ids).logits
        fused = fuse_rms_norms(model)
        got = model(input_ids).logits
    assert sorted(fused) == sorted(
        [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm",
                                                            "post_attention_layernorm")]
        + ["model.norm"])
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gemmas_one_plus_weight_norm_is_left_alone():
    model = built(GemmaForCausalLM, GemmaConfig, torch.bfloat16)
    assert fuse_rms_norms(model) == []


class SumOverN(nn.Module):
    """Llama's formula with the mean spelled sum / n: within an ulp of the fused op, but not
    the batch-invariant mean's bits under the mode."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        variance = x.pow(2).sum(-1, keepdim=True) / x.shape[-1]
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_under_batch_invariance_a_norm_runs_fused_only_with_its_forwards_bits(dtype, monkeypatch):
    """Under the mode the fused op's invariant form runs where it equals the module's own
    forward in the mode bit for bit (the trainer's side); a norm that only comes close runs its
    own forward there; with autograd every norm runs its own forward."""
    model = built(LlamaForCausalLM, LlamaConfig, dtype)
    close = SumOverN(512).to(dtype)
    fuse_rms_norms(model)
    assert fuse_rms_norms(close) == [""]  # close enough outside the mode
    calls = []
    monkeypatch.setattr(cpu_extension, "rms_norm",
                        lambda *a, op=cpu_extension.rms_norm, **k: calls.append(k) or op(*a, **k))
    norm = model.model.norm
    x, wide = torch.randn(5, 64).to(dtype) * 3, torch.randn(5, 512).to(dtype) * 3
    with torch.inference_mode(), set_batch_invariant_mode():
        got = norm(x)
        expected = type(norm).forward(norm, x)
        assert torch.equal(close(wide), type(close).forward(close, wide))
    assert torch.equal(got, expected) and len(calls) == 1
    norm(x.requires_grad_()).sum().backward()  # autograd: the torch ops, with a gradient
    assert len(calls) == 1 and norm.weight.grad is not None
