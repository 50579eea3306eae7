"""Triton kernels under TRITON_INTERPRET=1 on CPU tensors, against the oracle and the reference."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kernels
import kernels.dispatch
from kernels.paged_attention_ref import store_kv_cache_ref
from rollout_engine import LLM, SamplingParams
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

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton)"
)

TRITON_MODULES = (
    "kernels.triton_utils", "kernels.triton_kv_store", "kernels.triton_paged_attention",
    "kernels.triton_lora", "kernels.triton_moe",
)


@pytest.fixture(scope="module")
def triton_kernels():
    """Fresh imports of the kernel modules with the interpreter on, restored afterwards.

    `triton.jit` picks the interpreter when a kernel is defined, so the modules are
    imported here rather than at the top, and dropped again (from sys.modules and from the
    package's attributes) so that a later import in the same session, say a GPU test,
    compiles real kernels.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        for name in TRITON_MODULES:
            mp.delitem(sys.modules, name, raising=False)
            mp.delattr(kernels, name.rpartition(".")[2], raising=False)
        attention = importlib.import_module("kernels.triton_paged_attention")
        store = importlib.import_module("kernels.triton_kv_store")
        lora = importlib.import_module("kernels.triton_lora")
        moe = importlib.import_module("kernels.triton_moe")
        yield SimpleNamespace(attention=attention, store=store, lora=lora, moe=moe)
        for name in TRITON_MODULES:
            sys.modules.pop(name, None)
            if hasattr(kernels, name.rpartition(".")[2]):
                delattr(kernels, name.rpartition(".")[2])


def test_importing_kernels_does_not_import_triton():
    # `import transformers` imports this package while probing for another `kernels`.
    code = "import sys, kernels; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_kernels_call_only_triton_builtins(triton_kernels):
    # triton.language's own jit helpers (tl.max, tl.cdiv, ...) are compiled or interpreted
    # depending on the mode at Triton's first import; a kernel calling them would break
    # whenever that mode differs from the one its module was imported in.
    modules = (triton_kernels.attention, triton_kernels.store, triton_kernels.lora)
    used, jit_helpers = triton_language_use(*modules)
    assert {"dot", "load", "store", "reduce"} <= used
    assert not jit_helpers, f"kernels call triton.language jit helpers: {jit_helpers}"


def triton_language_use(*modules) -> tuple[set[str], list[str]]:
    """The `tl.` names the modules use, and those of them that are triton.language's jit
    helpers rather than builtins."""
    import triton.language as tl
    from triton.runtime.jit import KernelInterface

    used: set[str] = set()
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        used |= {node.attr for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                 and node.value.id == "tl"}
    return used, sorted(name for name in used if isinstance(getattr(tl, name), KernelInterface))


def attend(kernels_ns, case, config=None):
    attention = kernels_ns.attention
    if config is None:
        return attention.paged_attention_triton(case.query, case.key_cache, case.value_cache,
                                                case.metadata, case.scale, **case.options)
    return attention.paged_attention_launch(case.query, case.key_cache, case.value_cache,
                                            case.metadata, case.scale, config, **case.options)


def assert_close(out, case, dtype):
    assert out.shape == case.output_shape and out.dtype == dtype
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[dtype], f"max error {err} > {ATOL[dtype]} for {dtype}"


@pytest.mark.parametrize("name", list(CASES))
def test_attention_fp32_default_config(triton_kernels, name):
    case = make_named_case(name)
    assert_close(attend(triton_kernels, case), case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["mixed", "group3"])
def test_attention_half_precision(triton_kernels, name, dtype):
    case = make_named_case(name, dtype=dtype)
    assert_close(attend(triton_kernels, case), case, dtype)


@pytest.mark.parametrize("block_m,tile_n,num_splits", [(16, 16, 1), (64, 16, 1), (16, 16, 4)])
@pytest.mark.parametrize("name", ["block_edges", "long_decode"])
def test_attention_tile_sizes_and_kv_splits(triton_kernels, name, block_m, tile_n, num_splits):
    # Tiles smaller than the sequences: many KV tiles, tiles straddling cache blocks, and
    # splits of the KV range of which some are empty for the short rows.
    case = make_named_case(name)
    config = triton_kernels.attention.LaunchConfig(block_m, tile_n, num_splits)
    assert_close(attend(triton_kernels, case, config), case, torch.float32)


@pytest.mark.parametrize("window", SLIDING_WINDOWS)
@pytest.mark.parametrize("name", list(CASES))
def test_attention_with_a_sliding_window(triton_kernels, name, window):
    case = make_named_case(name, sliding_window=window)
    assert_close(attend(triton_kernels, case), case, torch.float32)


@pytest.mark.parametrize("window", [3, 9])
@pytest.mark.parametrize("block_m,tile_n,num_splits", [(16, 16, 1), (16, 16, 4)])
def test_sliding_window_with_small_tiles_and_kv_splits(triton_kernels, window, block_m, tile_n,
                                                       num_splits):
    # Tiles and splits that begin before, inside and after a row's window; some splits are
    # wholly outside it.
    case = make_named_case("long_decode", sliding_window=window)
    config = triton_kernels.attention.LaunchConfig(block_m, tile_n, num_splits)
    assert_close(attend(triton_kernels, case, config), case, torch.float32)
    prefill = make_case([20, 1], [37, 30], sliding_window=window, seed=3)
    assert_close(attend(triton_kernels, prefill, config), prefill, torch.float32)


def test_attention_bf16_with_kv_splits(triton_kernels):
    case = make_named_case("long_decode", dtype=torch.bfloat16)
    config = triton_kernels.attention.LaunchConfig(16, 16, num_splits=2)
    assert_close(attend(triton_kernels, case, config), case, torch.bfloat16)


def test_attention_matches_reference_on_a_strided_query(triton_kernels):
    # The decoder hands over views; a query that is a slice of a wider tensor must work.
    case = make_named_case("mixed")
    wide = torch.randn(case.query.shape[0], case.query.shape[1], 40)
    wide[..., :16] = case.query
    case.query = wide[..., :16]
    assert not case.query.is_contiguous()
    assert_close(attend(triton_kernels, case), case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_matches_reference(triton_kernels, dtype):
    case = make_case([1, 7, 3], [10, 7, 13], dtype=dtype, seed=6)
    num_tokens, num_kv_heads, head_dim = 11, case.key_cache.shape[2], case.key_cache.shape[3]
    # A strided key, as a slice of a wider projection would be.
    key = torch.randn(num_tokens, num_kv_heads, 2 * head_dim).to(dtype)[..., :head_dim]
    value = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype)
    original = case.key_cache.clone()
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    store_kv_cache_ref(key, value, expected_k, expected_v, case.metadata.slot_mapping)
    triton_kernels.store.store_kv_cache_triton(key, value, case.key_cache, case.value_cache,
                                               case.metadata.slot_mapping)
    assert not torch.equal(case.key_cache, original)
    assert torch.equal(case.key_cache, expected_k) and torch.equal(case.value_cache, expected_v)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", ["mha_odd", "group3"])
def test_attention_with_softcap_sinks_and_value_widths(triton_kernels, name, feature):
    # The default config: one program per tile sees the whole KV (sinks start its softmax).
    case = make_named_case(name, **FEATURES[feature])
    assert_close(attend(triton_kernels, case), case, torch.float32)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_softcap_sinks_and_value_widths_with_kv_splits(triton_kernels, feature):
    # Four splits of five KV tiles: no split counts the sinks, the merge adds them once.
    case = make_named_case("long_decode", **FEATURES[feature])
    config = triton_kernels.attention.LaunchConfig(16, 16, num_splits=4)
    assert_close(attend(triton_kernels, case, config), case, torch.float32)


def test_every_feature_in_bf16_with_kv_splits(triton_kernels):
    case = make_named_case("long_decode", dtype=torch.bfloat16, softcap=2.0, sinks=True,
                           value_head_dim=24)
    config = triton_kernels.attention.LaunchConfig(16, 16, num_splits=2)
    assert_close(attend(triton_kernels, case, config), case, torch.bfloat16)


def test_store_writes_values_of_their_own_width(triton_kernels):
    case = make_case([1, 7, 3], [10, 7, 13], value_head_dim=40, seed=6)
    key = torch.randn(11, 2, 16)
    value = torch.randn(11, 2, 40)
    expected_k, expected_v = case.key_cache.clone(), case.value_cache.clone()
    naive_store(key, value, expected_k, expected_v, case.metadata.slot_mapping)
    triton_kernels.store.store_kv_cache_triton(key, value, case.key_cache, case.value_cache,
                                               case.metadata.slot_mapping)
    assert torch.equal(case.key_cache, expected_k) and torch.equal(case.value_cache, expected_v)


def test_store_skips_negative_slots(triton_kernels):
    case = make_case([2], [2], seed=7)
    before = case.key_cache.clone()
    key = torch.randn(2, 2, 16)
    slots = torch.tensor([-1, int(case.metadata.slot_mapping[1])])
    triton_kernels.store.store_kv_cache_triton(key, key, case.key_cache, case.value_cache, slots)
    changed = (case.key_cache != before).view(-1, 2, 16).any(-1).any(-1).nonzero().flatten()
    assert changed.tolist() == [int(slots[1])]


def test_store_then_attend_round_trip(triton_kernels):
    case = make_named_case("mixed")
    num_tokens = case.query.shape[0]
    key, value = torch.randn(num_tokens, 2, 16), torch.randn(num_tokens, 2, 16)
    triton_kernels.store.store_kv_cache_triton(key, value, case.key_cache, case.value_cache,
                                               case.metadata.slot_mapping)
    assert_close(attend(triton_kernels, case), case, torch.float32)


def test_engine_greedy_tokens_unchanged_with_triton_attention(triton_kernels, llama_dir,
                                                              monkeypatch):
    prompts = [[5, 17, 3, 99, 42], [7 + i for i in range(21)]]
    # A small token budget chunks the long prompt while the short one decodes: mixed batches.
    options = {"max_num_batched_tokens": 8, "block_size": 4}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = LLM(str(llama_dir), **options).generate(prompts, params)
    expected = [o.outputs[0].token_ids for o in reference]

    num_triton_calls = 0

    def use_triton(t: torch.Tensor) -> bool:
        nonlocal num_triton_calls
        num_triton_calls += 1
        return True

    monkeypatch.setattr(kernels.dispatch, "_use_triton", use_triton)
    outputs = LLM(str(llama_dir), **options).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert num_triton_calls >= 2 * 2 * 5, "every layer of every step should go through Triton"


def compile_for_hopper() -> list[str]:
    """Compile each kernel for sm_90 with Triton's bundled ptxas: no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import triton_kv_store, triton_lora, triton_moe, triton_paged_attention
    from kernels.triton_utils import next_power_of_2

    target = GPUTarget("cuda", 90, 32)
    compiled = []

    def build(kernel, pointer_types: dict[str, str], constexprs: dict, **options) -> None:
        signature = {name: "constexpr" if name in constexprs else pointer_types.get(name, "i32")
                     for name in kernel.arg_names}
        triton.compile(ASTSource(kernel, signature, constexprs), target=target, options=options)
        compiled.append(kernel.__name__)

    # (dtype, BLOCK_M, splits, head dim of keys, of values, softcap and sinks): the last two
    # are multi-head latent attention's widths with every feature.
    for dtype, block_m, num_splits, head_dim, head_dim_v, features in (
        ("bf16", 16, 1, 128, 128, False), ("fp16", 64, 1, 128, 128, False),
        ("bf16", 16, 4, 128, 128, False), ("bf16", 16, 1, 192, 128, True),
        ("bf16", 16, 4, 192, 128, True),
    ):
        pointers = {name: "*" + dtype for name in ("out_ptr", "query_ptr", "key_cache_ptr",
                                                   "value_cache_ptr")}
        pointers |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr",
                                               "query_start_loc_ptr")}
        pointers |= {name: "*fp32" for name in ("partial_out_ptr", "partial_max_ptr",
                                                "partial_sum_ptr", "sinks_ptr")}
        pointers |= {name: "fp32" for name in ("scale_log2", "softcap_scale", "softcap_log2")}
        build(triton_paged_attention._paged_attention_kernel, pointers, {
            "GROUP": 4, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_power_of_2(head_dim),
            "HEAD_DIM_V": head_dim_v, "HEAD_DIM_V_PAD": head_dim_v, "BLOCK_SIZE": 16,
            "BLOCK_M": block_m, "BLOCK_Q": block_m // 4, "TILE_N": 64 if head_dim <= 128 else 32,
            "NUM_SPLITS": num_splits, "SLIDING": features, "SOFTCAP": features,
            "HAS_SINKS": features, "UPCAST": False, "DOT_PRECISION": "tf32"},
            num_warps=4, num_stages=2)
    merge = triton_paged_attention._merge_splits_kernel
    partials = {n: "*fp32" for n in merge.arg_names if n.startswith("partial")}
    for has_sinks in (False, True):
        build(merge, {"out_ptr": "*bf16", "sinks_ptr": "*fp32"} | partials,
              {"HEAD_DIM_V": 128, "HEAD_DIM_V_PAD": 128, "NUM_SPLITS": 4,
               "HAS_SINKS": has_sinks})
    store = triton_kv_store._store_kv_kernel
    build(store, {n: "*bf16" for n in store.arg_names if n.endswith("_ptr")}
          | {"slot_mapping_ptr": "*i64"},
          {"NUM_KV_HEADS": 8, "HEAD_DIM": 192, "BLOCK_SIZE": 16, "HEADS_PAD": 8,
           "HEAD_DIM_PAD": 256, "HEAD_DIM_V": 128, "HEAD_DIM_V_PAD": 128})
    # LoRA at rank 64 over a bf16 model (the launch's tile sizes); indexes int32.
    indexes = {"row_slots_ptr": "*i32", "slot_rows_ptr": "*i32", "blocks_ptr": "*i32",
               "ranks_ptr": "*i32", "shrunk_ptr": "*fp32"}
    shrink, expand = triton_lora._lora_shrink_kernel, triton_lora._lora_expand_kernel
    build(shrink, {"x_ptr": "*bf16", "a_ptr": "*bf16"} | indexes,
          {"BLOCK_R": 128, "BLOCK_K": triton_lora._BLOCK_K})
    build(expand, {"bt_ptr": "*bf16", "out_ptr": "*bf16"} | indexes,
          {"BLOCK_RANK": 64, "BLOCK_N": 128})
    # Fused MoE over bf16 experts, decode- and prefill-sized blocks (tensor-core dots).
    blocks = {"pair_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
    for block_m in (16, 64):
        tiles = {"BLOCK_M": block_m, "BLOCK_N": triton_moe._BLOCK_N,
                 "BLOCK_K": triton_moe._BLOCK_K, "UPCAST": False, "DOT_PRECISION": "tf32"}
        build(triton_moe._gate_up_kernel,
              {"x_ptr": "*bf16", "w_ptr": "*bf16", "inter_ptr": "*bf16"} | blocks, tiles)
        build(triton_moe._down_kernel, {"inter_ptr": "*bf16", "w_ptr": "*bf16",
                                        "weights_ptr": "*bf16", "out_ptr": "*fp32"} | blocks,
              tiles)
    return compiled


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    # Catches what the interpreter cannot: type errors of the compiler, dot shape limits,
    # shared-memory layout. Run in a fresh process: the interpreter must be off there.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from tests.unit.test_kernels_triton import compile_for_hopper; "
            "print(' '.join(compile_for_hopper()))")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False,
        timeout=300, cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == (["_paged_attention_kernel"] * 5
                                     + ["_merge_splits_kernel"] * 2 + ["_store_kv_kernel",
                                     "_lora_shrink_kernel", "_lora_expand_kernel"]
                                     + ["_gate_up_kernel", "_down_kernel"] * 2)
