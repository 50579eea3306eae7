"""Triton kernels compiled for the GPU against the torch reference, on realistic shapes."""

from __future__ import annotations

import importlib
import importlib.util
import random

import pytest
import torch

from kernels import AttentionMetadata, paged_attention
from kernels.paged_attention_ref import paged_attention_ref, store_kv_cache_ref
from tests.unit.kernel_cases import AttentionCase, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


# Imported when a test runs, so collecting this file never imports Triton.
def attention_module():
    return importlib.import_module("kernels.triton_paged_attention")


def store_kv_cache_triton(*args) -> None:
    importlib.import_module("kernels.triton_kv_store").store_kv_cache_triton(*args)


def paged_attention_triton(*args, **options) -> torch.Tensor:
    return attention_module().paged_attention_triton(*args, **options)


# Against the reference run in float64 on the same (rounded) inputs.
GPU_ATOL = {torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _lens(rng: random.Random, num: int, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(num)]


def _shapes() -> dict[str, tuple[list[int], list[int], dict]]:
    rng = random.Random(0)
    decode = _lens(rng, 48, 20, 1500)
    long_rows = _lens(rng, 3, 2000, 4000)
    llama = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
    return {
        "decode_batch": ([1] * 48, decode, llama),
        "few_long_decode": ([1] * 3, long_rows, llama),
        "mixed": ([1] * 8 + [4, 4, 300, 129], _lens(rng, 8, 10, 900) + [50, 600, 500, 129], llama),
        "spec_verify": ([4] * 16, _lens(rng, 16, 8, 700), llama),
        "qwen_small_heads": ([1] * 6 + [77], _lens(rng, 6, 5, 400) + [77],
                             {"num_heads": 14, "num_kv_heads": 2, "head_dim": 64}),
        "mha_hd96": ([1, 40, 1], [300, 90, 17],
                     {"num_heads": 8, "num_kv_heads": 8, "head_dim": 96, "block_size": 32}),
        "hd256": ([1, 33], [500, 100], {"num_heads": 8, "num_kv_heads": 1, "head_dim": 256}),
        # Multi-head latent attention as Hugging Face runs DeepSeek-V2/V3: 192-wide keys,
        # 128-wide values.
        "mla_dk192_dv128": ([1] * 6 + [4, 70], _lens(rng, 6, 10, 900) + [300, 70],
                            {"num_heads": 16, "num_kv_heads": 16, "head_dim": 192,
                             "value_head_dim": 128}),
    }


SHAPES = _shapes()


def cuda_case(name: str, dtype: torch.dtype, **overrides) -> AttentionCase:
    query_lens, seq_lens, options = SHAPES[name]
    return make_case(query_lens, seq_lens, dtype=dtype, device="cuda", seed=1,
                     **{**options, **overrides})


def reference_fp64(case: AttentionCase) -> torch.Tensor:
    # SDPA's math backend, or the explicit path in float64: no TF32, no reduced precision.
    exact = case.cast(torch.float64)
    return paged_attention_ref(exact.query, exact.key_cache, exact.value_cache, exact.metadata,
                               exact.scale, **exact.options)


def assert_close(out: torch.Tensor, case: AttentionCase) -> None:
    dtype = case.query.dtype
    assert out.shape == case.output_shape and out.dtype == dtype
    err = (out.double() - reference_fp64(case)).abs().max().item()
    assert err <= GPU_ATOL[dtype], f"max error {err} > {GPU_ATOL[dtype]} ({dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_attention_matches_reference(name, dtype):
    case = cuda_case(name, dtype)
    out = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.metadata,
                                 case.scale)
    assert_close(out, case)


@pytest.mark.parametrize("window", [1, 100, 1024])
@pytest.mark.parametrize("name", ["decode_batch", "few_long_decode", "mixed", "spec_verify"])
def test_attention_with_a_sliding_window(name, window):
    # Windows of one token, of a few blocks, and longer than some rows (KV splits included).
    case = cuda_case(name, torch.bfloat16)
    case.sliding_window = window
    out = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.metadata,
                                 case.scale, window)
    assert_close(out, case)


@pytest.mark.parametrize("config", [(16, 32, 1), (64, 64, 1), (16, 64, 4), (16, 16, 16)],
                         ids=lambda c: "block_m{}-tile_n{}-splits{}".format(*c))
@pytest.mark.parametrize("name", ["mixed", "few_long_decode"])
def test_attention_forced_configs(name, config):
    case = cuda_case(name, torch.bfloat16)
    attention = attention_module()
    out = attention.paged_attention_launch(case.query, case.key_cache, case.value_cache,
                                           case.metadata, case.scale,
                                           attention.LaunchConfig(*config))
    assert_close(out, case)


# Gemma 2's softcap (50), gpt-oss's sinks, both with a window of a few blocks.
FEATURES = {
    "softcap": {"softcap": 50.0},
    "sinks": {"sinks": True},
    "softcap_sinks_window": {"softcap": 50.0, "sinks": True, "sliding_window": 100},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", ["decode_batch", "few_long_decode", "mixed", "spec_verify",
                                  "mla_dk192_dv128"])
def test_attention_with_softcap_and_sinks(name, feature):
    # few_long_decode splits the KV (the merge adds the sinks); the others do not.
    case = cuda_case(name, torch.bfloat16, **FEATURES[feature])
    out = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.metadata,
                                 case.scale, **case.options)
    assert_close(out, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_feature_in_other_dtypes(dtype):
    case = cuda_case("mla_dk192_dv128", dtype, **FEATURES["softcap_sinks_window"])
    out = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.metadata,
                                 case.scale, **case.options)
    assert_close(out, case)


@pytest.mark.parametrize("config", [(16, 32, 1), (16, 64, 4), (16, 16, 16)],
                         ids=lambda c: "block_m{}-tile_n{}-splits{}".format(*c))
@pytest.mark.parametrize("name", ["few_long_decode", "mla_dk192_dv128"])
def test_softcap_and_sinks_with_forced_configs(name, config):
    case = cuda_case(name, torch.bfloat16, softcap=30.0, sinks=True)
    attention = attention_module()
    out = attention.paged_attention_launch(case.query, case.key_cache, case.value_cache,
                                           case.metadata, case.scale,
                                           attention.LaunchConfig(*config), **case.options)
    assert_close(out, case)


def test_softcap_and_sinks_change_the_answer():
    # An implementation that ignored them would give the plain answer: far from the right one.
    case = cuda_case("decode_batch", torch.float32, softcap=5.0, sinks=True)
    plain = paged_attention_triton(case.query, case.key_cache, case.value_cache, case.metadata,
                                   case.scale)
    assert (plain.double() - reference_fp64(case)).abs().max() > 1e-2


def test_dispatch_passes_the_options_to_triton():
    case = cuda_case("mla_dk192_dv128", torch.float16, softcap=50.0, sinks=True)
    args = (case.query, case.key_cache, case.value_cache, case.metadata, case.scale)
    assert torch.equal(paged_attention(*args, **case.options),
                       paged_attention_triton(*args, **case.options))


def test_store_writes_values_of_their_own_width():
    case = cuda_case("mla_dk192_dv128", torch.bfloat16)
    num_tokens, num_kv_heads = case.query.shape[0], case.key_cache.shape[2]
    key = torch.randn(num_tokens, num_kv_heads, 192, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(num_tokens, num_kv_heads, 128, device="cuda", dtype=torch.bfloat16)
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    store_kv_cache_ref(key, value, expected_k, expected_v, case.metadata.slot_mapping)
    store_kv_cache_triton(key, value, case.key_cache, case.value_cache, case.metadata.slot_mapping)
    assert torch.equal(case.key_cache, expected_k) and torch.equal(case.value_cache, expected_v)


def test_small_decode_batches_split_the_kv_and_prefill_does_not():
    choose_config = attention_module().choose_config
    few = cuda_case("few_long_decode", torch.float16)
    assert choose_config(few.query, few.key_cache, few.metadata).num_splits > 1
    mixed = cuda_case("mixed", torch.float16)
    assert choose_config(mixed.query, mixed.key_cache, mixed.metadata).num_splits == 1


def test_dispatch_sends_cuda_tensors_to_triton():
    case = cuda_case("mixed", torch.float16)
    args = (case.query, case.key_cache, case.value_cache, case.metadata, case.scale)
    assert torch.equal(paged_attention(*args), paged_attention_triton(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_matches_reference(dtype):
    case = cuda_case("mixed", dtype)
    num_tokens, (_, _, num_kv_heads, head_dim) = case.query.shape[0], case.key_cache.shape
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    store_kv_cache_ref(key, value, expected_k, expected_v, case.metadata.slot_mapping)
    store_kv_cache_triton(key, value, case.key_cache, case.value_cache, case.metadata.slot_mapping)
    assert torch.equal(case.key_cache, expected_k) and torch.equal(case.value_cache, expected_v)


def test_block_offsets_past_int32():
    # block_id * block_stride passes 2**31 elements for the last blocks of this cache.
    num_blocks, block_size, num_kv_heads, head_dim = (1 << 20) + 64, 16, 2, 64
    cache_bytes = num_blocks * block_size * num_kv_heads * head_dim * 2
    if torch.cuda.mem_get_info()[0] < 3 * cache_bytes:
        pytest.skip("not enough free GPU memory for two caches past 2**31 elements")
    query_lens, seq_lens = [1, 20], [40, 20]
    case = make_case(query_lens, seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=torch.float16, device="cuda", seed=2)
    # The same batch with block b moved to block num_blocks - 1 - b of a huge cache.
    tables = [[num_blocks - 1 - b for b in row[: -(-s // block_size)]]
              for row, s in zip(case.metadata.block_tables.tolist(), seq_lens)]
    high = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device="cuda")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.empty(shape, dtype=torch.float16, device="cuda")
    value_cache = torch.empty(shape, dtype=torch.float16, device="cuda")
    moved = num_blocks - 1 - torch.arange(case.key_cache.shape[0], device="cuda")
    key_cache[moved], value_cache[moved] = case.key_cache, case.value_cache
    out = paged_attention_triton(case.query, key_cache, value_cache, high, case.scale)
    expected = paged_attention_triton(case.query, case.key_cache, case.value_cache,
                                      case.metadata, case.scale)
    assert torch.equal(out, expected)
    key = torch.randn(sum(query_lens), num_kv_heads, head_dim, device="cuda",
                      dtype=torch.float16)
    store_kv_cache_triton(key, key, key_cache, value_cache, high.slot_mapping)
    assert torch.equal(key_cache.view(-1, num_kv_heads, head_dim)[high.slot_mapping], key)
