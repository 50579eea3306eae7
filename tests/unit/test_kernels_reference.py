"""The torch reference kernels (the CPU path and the GPU oracle) against naive per-token math."""

from __future__ import annotations

import pytest
import torch

import kernels.paged_attention_ref
from kernels import AttentionMetadata, paged_attention, store_kv_cache
from kernels.paged_attention_ref import (
    MAX_BATCHED_QUERY_LEN,
    paged_attention_ref,
    store_kv_cache_ref,
)
from tests.unit.kernel_cases import (
    ATOL,
    CASES,
    FEATURES,
    SLIDING_WINDOWS,
    make_case,
    make_named_case,
    naive_attention,
    naive_store,
)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_naive_attention(name):
    case = make_named_case(name)
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    expected = naive_attention(case)
    err = (out.double() - expected).abs().max().item()
    assert err <= ATOL[torch.float32], f"{name}: max error {err}"


@pytest.mark.parametrize("window", SLIDING_WINDOWS)
@pytest.mark.parametrize("name", list(CASES))
def test_reference_honours_a_sliding_window(name, window):
    case = make_named_case(name, sliding_window=window)
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, window)
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[torch.float32], f"{name}, window {window}: max error {err}"


def test_a_window_shorter_than_the_context_changes_the_answer():
    # The oracle itself: a window of 3 hides keys a full causal attention sees.
    case = make_named_case("long_decode")
    windowed = make_named_case("long_decode", sliding_window=3)
    assert not torch.allclose(naive_attention(case), naive_attention(windowed))
    full = paged_attention(case.query, case.key_cache, case.value_cache, case.metadata,
                           case.scale)
    assert not torch.allclose(full.double(), naive_attention(windowed), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_half_precision(dtype):
    case = make_named_case("mixed").cast(dtype)
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale)
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert out.dtype == dtype and err <= ATOL[dtype], f"max error {err}"


@pytest.mark.parametrize("query_len", [MAX_BATCHED_QUERY_LEN, MAX_BATCHED_QUERY_LEN + 1])
def test_batched_and_unbatched_paths_agree_at_the_threshold(query_len):
    # The same request alone, and next to decode rows: both paths give the oracle's answer.
    alone = make_case([query_len], [query_len + 5], seed=1)
    batch = make_case([1, query_len, 1], [7, query_len + 5, 30], seed=1)
    for case in (alone, batch):
        out = paged_attention_ref(case.query, case.key_cache, case.value_cache,
                                  case.metadata, case.scale)
        assert torch.allclose(out.double(), naive_attention(case), atol=1e-5)


def test_plan_is_built_once_per_step_and_reused_across_layers():
    case = make_named_case("mixed")
    first = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                                case.scale)
    plan = case.metadata.cache["ref_plan", None]
    # A second "layer": new queries, new cache contents, the same metadata.
    other = make_named_case("mixed", seed=5)
    second = paged_attention_ref(other.query, other.key_cache, other.value_cache,
                                 case.metadata, case.scale)
    assert case.metadata.cache["ref_plan", None] is plan
    assert not torch.allclose(first, second)
    other.metadata = case.metadata
    assert torch.allclose(second.double(), naive_attention(other), atol=1e-5)


def test_padding_of_block_tables_is_never_read():
    # Request 0 needs 1 block, request 1 needs 5: request 0's table is padded with block 0,
    # which request 1 owns; the cache is random everywhere, so reading it would show.
    case = make_case([1, 4], [3, 20], block_size=4, seed=2)
    tables = case.metadata.block_tables.tolist()
    assert len(tables[0]) > 1 and tables[0][1:] == [0] * (len(tables[0]) - 1)
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale)
    assert torch.allclose(out.double(), naive_attention(case), atol=1e-5)


def test_dispatch_uses_the_reference_on_cpu():
    case = make_named_case("block_edges")
    out = paged_attention(case.query, case.key_cache, case.value_cache, case.metadata,
                          case.scale)
    assert torch.allclose(out.double(), naive_attention(case), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_exactly_the_mapped_slots(dtype):
    case = make_named_case("mixed", dtype=dtype)
    num_tokens, (_, _, num_kv_heads, head_dim) = case.query.shape[0], case.key_cache.shape
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    naive_store(key, value, expected_k, expected_v, case.metadata.slot_mapping)
    store_kv_cache_ref(key, value, case.key_cache, case.value_cache, case.metadata.slot_mapping)
    assert torch.equal(case.key_cache, expected_k) and torch.equal(case.value_cache, expected_v)


def test_store_then_attend_sees_this_steps_tokens():
    # The engine's order: write the step's K/V, then attend; a token attends to itself.
    case = make_case([3, 1], [3, 6], seed=4)
    md: AttentionMetadata = case.metadata
    key = torch.randn(4, 2, 16)
    value = torch.randn(4, 2, 16)
    store_kv_cache(key, value, case.key_cache, case.value_cache, md.slot_mapping)
    out = paged_attention(case.query, case.key_cache, case.value_cache, md, case.scale)
    # The first prompt token sees only itself: its output is its own value, per head group.
    assert torch.allclose(out[0], value[0].repeat_interleave(2, dim=0), atol=1e-6)
    assert torch.allclose(out.double(), naive_attention(case), atol=1e-5)


# ---- softcap, sinks, values of their own width ---------------------------------------------


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", list(CASES))
def test_reference_with_softcap_sinks_and_value_widths(name, feature):
    case = make_named_case(name, **FEATURES[feature])
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, **case.options)
    assert out.shape == case.output_shape and out.dtype == case.query.dtype
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[torch.float32], f"{name}, {feature}: max error {err}"


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
def test_softcap_and_sinks_change_the_answer(feature):
    # The oracle itself, and the kernels through the dispatcher: an implementation that
    # ignored the option would give the plain answer, which is far from the right one.
    plain = make_named_case("mixed")
    featured = make_named_case("mixed", **FEATURES[feature])
    expected = naive_attention(featured)
    assert (naive_attention(plain) - expected).abs().max() > 1e-2
    out = paged_attention(featured.query, featured.key_cache, featured.value_cache,
                          featured.metadata, featured.scale, **featured.options)
    ref = paged_attention_ref(featured.query, featured.key_cache, featured.value_cache,
                              featured.metadata, featured.scale, **featured.options)
    for got in (out, ref):
        assert (got.double() - expected).abs().max() <= ATOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_half_precision_with_every_feature(dtype):
    case = make_named_case("mixed", **FEATURES["all"]).cast(dtype)
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, **case.options)
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert out.dtype == dtype and err <= ATOL[dtype], f"max error {err}"


def test_sinks_of_any_float_dtype():
    case = make_named_case("group3", sinks=True)
    case.sinks = case.sinks.to(torch.bfloat16)  # the oracle reads the same rounded logits
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, **case.options)
    assert (out.double() - naive_attention(case)).abs().max() <= ATOL[torch.float32]


def test_a_long_chunk_goes_through_the_explicit_path_in_slices(monkeypatch):
    # Scores of at most 100 elements: one query row (4 heads x <= 25 keys) per slice.
    monkeypatch.setattr(kernels.paged_attention_ref, "MAX_EXPLICIT_SCORES", 100)
    case = make_case([20, 1], [25, 9], softcap=1.5, sinks=True, value_head_dim=8,
                     sliding_window=7, seed=6)
    assert case.metadata.query_lens_cpu[0] > MAX_BATCHED_QUERY_LEN
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, **case.options)
    assert (out.double() - naive_attention(case)).abs().max() <= ATOL[torch.float32]


def test_plain_layers_keep_sdpa(monkeypatch):
    # Without a softcap or sinks nothing changes: SDPA for every request, values of any width.
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(args[2].shape[-1])
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(kernels.paged_attention_ref.F, "scaled_dot_product_attention",
                        counting_sdpa)
    case = make_named_case("mixed", value_head_dim=12)
    out = paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale)
    assert calls and set(calls) == {12}
    assert (out.double() - naive_attention(case)).abs().max() <= ATOL[torch.float32]
    calls.clear()
    paged_attention_ref(case.query, case.key_cache, case.value_cache, case.metadata,
                        case.scale, softcap=1.5)
    assert not calls


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
def test_store_writes_values_of_their_own_width(contiguous):
    case = make_named_case("mixed", value_head_dim=12)
    if not contiguous:  # heads-major storage behind the logical view
        case.key_cache = case.key_cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
        case.value_cache = case.value_cache.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    num_tokens, num_kv_heads = case.query.shape[0], case.key_cache.shape[2]
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(num_tokens, num_kv_heads, 16, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, 12, generator=gen)
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    naive_store(key, value, expected_k, expected_v, case.metadata.slot_mapping)
    store_kv_cache_ref(key, value, case.key_cache, case.value_cache, case.metadata.slot_mapping)
    assert torch.equal(case.key_cache, expected_k) and torch.equal(case.value_cache, expected_v)
