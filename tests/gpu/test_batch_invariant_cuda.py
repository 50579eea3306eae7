"""Batch invariance on a GPU (`kernels/triton_batch_invariant.py` compiled): a linear row's bits
alone equal its bits in a batch of any size, a token's attention is the same decoded, chunked or
batched, and end to end the engine's logprobs equal, bit for bit, the trainer bridge's forward
of the same tokens under `set_batch_invariant_mode()` (fp32 and bf16; dense and MoE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model, write_model_dir
from tests.integration.test_transformers_backend import CONFIGS, make_config
from tests.unit.kernel_cases import make_case
from tests.unit.test_batch_invariant_triton import STEPS, sub_batch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_rows_bits_do_not_depend_on_the_batch_on_cuda(dtype):
    from kernels import triton_batch_invariant as tbi

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4864, 896, generator=generator).to("cuda", dtype)
    x = torch.randn(513, 896, generator=generator).to("cuda", dtype)
    full = tbi.linear(x, weight)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 3), slice(64, 128), slice(1, 258)):
        assert torch.equal(tbi.linear(x[rows], weight), full[rows]), rows
    torch.testing.assert_close(full.float(), F.linear(x.float(), weight.float()),
                               atol=1e-3 if dtype == torch.float32 else 0.5, rtol=2e-2)
    cublas_changed = sum(not torch.equal(F.linear(x[i:i + 1], weight), F.linear(x, weight)[i:i + 1])
                         for i in range(0, 513, 64))
    print(f"{dtype}: cuBLAS rows whose bits change alone vs batched: {cublas_changed} of 9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_attention_is_the_same_decoded_chunked_or_batched_on_cuda(dtype):
    from kernels import triton_batch_invariant as tbi

    lengths = [45, 9, 70]
    case = make_case(lengths, lengths, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                     dtype=dtype, device="cuda")
    full = tbi.paged_attention(case.query, case.key_cache, case.value_cache, case.metadata,
                               case.scale)
    starts = case.metadata.query_start_loc.tolist()
    for step in STEPS:
        query, metadata = sub_batch(case, step)
        out = tbi.paged_attention(query, case.key_cache, case.value_cache, metadata, case.scale)
        at = 0
        for request, (lo, hi) in step.items():
            assert torch.equal(out[at:at + hi - lo],
                               full[starts[request] + lo:starts[request] + hi]), (step, request)
            at += hi - lo


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bi_cuda")
    return {"llama": str(build_tiny_model(root / "llama", "llama", "small")),
            "qwen3_moe": str(write_model_dir(root / "moe", make_config(*CONFIGS["qwen3_moe"])))}


@pytest.mark.parametrize(("family", "dtype"), [("llama", "float32"), ("llama", "bfloat16"),
                                               ("qwen3_moe", "bfloat16")])
def test_the_engines_logprobs_are_the_trainers_on_cuda(model_dirs, family, dtype):
    from transformers import AutoModelForCausalLM

    from trainer_bridge.invariant_logps import per_token_logps_and_entropies

    prompts = [[5, 9, 14, 5, 9, 14, 5, 9] * 3, list(range(20, 120)), [300, 301]]
    params = SamplingParams(n=4, temperature=0.8, max_tokens=24, logprobs=0, seed=3,
                            ignore_eos=True)
    llm = LLM(model_dirs[family], dtype=dtype, device="cuda", batch_invariant=True,
              max_num_batched_tokens=32, kv_cache_bytes=256 * 1024**2)
    outputs = llm.generate(prompts, params)
    llm.shutdown()
    trainer = AutoModelForCausalLM.from_pretrained(
        model_dirs[family], dtype=getattr(torch, dtype), attn_implementation="sdpa").cuda().eval()
    differ = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        completions = [list(sample.token_ids) for sample in output.outputs]
        ids = torch.tensor([prompt + c for c in completions], device="cuda")  # one padded batch
        with torch.no_grad():
            expected, _, _ = per_token_logps_and_entropies(
                trainer, ids, torch.ones_like(ids), params.max_tokens, params.temperature)
        for sample, row in zip(output.outputs, expected.cpu(), strict=True):
            differ += not torch.equal(torch.tensor(sample.logprobs), row)
    assert differ == 0
