"""CPU linears on packed oneDNN copies: the same tokens as plain `F.linear`, and copies that
never outlive the weights they were packed from (sleep, wake, updates)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollout_engine import LLM, SamplingParams
from rollout_engine.worker.models.packed_linear import can_pack, gemm_dtype, pack, row_bucket
from tests.integration.hf_oracle import hf_greedy
from tests.integration.test_weight_update import checkpoint

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42], list(range(20, 52))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="torch without oneDNN"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_packed_linear_is_the_linears_side_by_side(dtype) -> None:
    if not can_pack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (bf16 needs AVX-512 or NE-CONVERT)")
    torch.manual_seed(0)
    weights = [torch.randn(n, 48, dtype=dtype) for n in (64, 16, 16)]
    biases = [torch.randn(n, dtype=dtype) for n in (64, 16, 16)]
    packed = pack(weights, biases)
    for num_rows in (1, 8, 33, 300):  # any row count, whatever the packing's hint
        x = torch.randn(num_rows, 48, dtype=dtype)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for got, w, b in zip(packed(x), weights, biases, strict=True):
            torch.testing.assert_close(got, F.linear(x, w, b), atol=tol, rtol=tol)
    element_bytes = torch.finfo(gemm_dtype(dtype)).bits // 8  # float32 copies of bf16: below
    assert packed.num_bytes == sum(w.numel() + b.numel() for w, b in zip(weights, biases)) * (
        element_bytes
    )


def test_bf16_weights_pack_as_float32_where_the_cpu_has_no_bf16_arithmetic(monkeypatch) -> None:
    """Without AVX-512 BF16 a bfloat16 GEMM is emulated (3-4.5x slower than float32 here): the
    copies are float32, the outputs bfloat16 and what a bfloat16 GEMM gives (exact products,
    float32 sums, one rounding), up to the order of the sums."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert gemm_dtype(torch.bfloat16) == torch.float32 and can_pack(torch.device("cpu"),
                                                                     torch.bfloat16)
    torch.manual_seed(0)
    weights = [torch.randn(n, 48, dtype=torch.bfloat16) for n in (64, 16)]
    biases = [torch.randn(n, dtype=torch.bfloat16) for n in (64, 16)]
    packed = pack(weights, biases)
    assert packed.weight.dtype == packed.bias.dtype == torch.float32
    assert packed.num_bytes == sum(w.numel() + b.numel() for w, b in zip(weights, biases)) * 4
    for num_rows in (1, 33, 300):
        x = torch.randn(num_rows, 48, dtype=torch.bfloat16)
        for got, w, b in zip(packed(x), weights, biases, strict=True):
            assert got.dtype == torch.bfloat16
            exact = F.linear(x.double(), w.double(), b.double())  # float64: every sum exact
            # One rounding to bfloat16 (half an ulp: 2^-9 relative), the float32 sums' order.
            torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=2**-8)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert gemm_dtype(torch.bfloat16) == torch.bfloat16  # oneDNN's own bf16 GEMM there
    assert gemm_dtype(torch.float32) == torch.float32


def test_a_bf16_engine_without_bf16_arithmetic_runs_float32_copies(monkeypatch,
                                                                   llama_dir) -> None:
    """The engine in bfloat16 on such a CPU: its packed copies are float32 and its greedy tokens
    and logprobs those of the same engine on `F.linear` in bfloat16."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    outputs = {}
    for packed in (True, False):
        llm = LLM(str(llama_dir), dtype="bfloat16", kv_cache_bytes=1 << 20,
                  cpu_packed_weights=packed)
        outputs[packed] = llm.generate(PROMPTS, params, use_tqdm=False)
        if packed:
            model = llm.engine.worker.model_runner.model
            assert llm.engine.worker.packed_weights.is_packed
            assert model.packed_logits.weight.dtype == torch.float32
            assert all(layer.mlp.packed_gate_up.weight.dtype == torch.float32
                       for layer in model.model.layers)
        llm.shutdown()
    for a, b in zip(outputs[True], outputs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                   torch.tensor(b.outputs[0].logprobs), atol=2e-2, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_packed_and_plain_linears_give_transformers_greedy_tokens(tiny_model_dirs, arch) -> None:
    model_dir = str(tiny_model_dirs[arch])
    expected = [hf_greedy(model_dir, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    for packed in (True, False):
        llm = LLM(model_dir, kv_cache_bytes=1 << 20, cpu_packed_weights=packed)
        assert (llm.engine.worker.packed_weights is not None) is packed
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert got == expected, f"packed={packed}"
        if packed:
            assert llm.engine.worker.packed_weights.is_packed  # the forward ran on them


@pytest.mark.parametrize("level", [1, 2])
def test_packed_copies_follow_the_weights_through_sleep(llama_dir, level) -> None:
    """Level 2 discards the weights and their copies (packed again from the update that must
    follow); level 1 restores the weights as they were, and keeps the copies."""
    llm = LLM(str(llama_dir), kv_cache_bytes=1 << 20)
    packed = llm.engine.worker.packed_weights
    weights = checkpoint(llama_dir)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert packed.is_packed and packed.num_packs == 1 and packed.num_bytes > 0
    llm.sleep(level=level)
    assert packed.is_packed == (level == 1)
    assert (packed.num_bytes == 0) == (level == 2)  # freed with the weights
    if level == 2:
        llm.wake_up(["weights"])
        llm.update_weights(weights)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == before
    assert packed.num_packs == level  # level 2: packed again, from the updated weights


def test_varying_row_counts_do_not_grow_resident_memory() -> None:
    """oneDNN keeps a primitive per distinct row count; rows are padded to a few buckets, so a
    server whose batches vary does not grow (about 0.5 MB a row count for a small weight)."""
    import os

    from memory import process_rss_bytes

    packed = pack([torch.randn(256, 64)])
    for num_rows in (16, 256, 320, 384, 448, 512, 640, 768, 896, 1024):  # the rows' buckets
        packed(torch.randn(num_rows, 64))
    before = process_rss_bytes(os.getpid())
    for num_rows in range(200, 1025):  # unpadded: 825 new primitives, some 400 MB
        packed(torch.randn(num_rows, 64))
    assert process_rss_bytes(os.getpid()) - before < 20 * 1024**2
    assert len({row_bucket(n) for n in range(1, 2049)}) == 16 + 12


def test_row_buckets_pad_at_most_a_quarter_above_256_rows() -> None:
    buckets = {n: row_bucket(n) for n in range(1, 8193)}
    assert all(b >= n and b % 16 == 0 for n, b in buckets.items())
    assert all(b - n < 16 for n, b in buckets.items() if n <= 256)
    assert max((b - n) / n for n, b in buckets.items() if n > 256) <= 0.25
    assert [buckets[n] for n in (256, 257, 320, 321, 512, 513, 1025, 2048)] == [
        256, 320, 320, 384, 512, 640, 1280, 2048]
    assert all(row_bucket(b) == b for b in buckets.values())  # a bucket is its own bucket
