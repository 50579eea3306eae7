"""The CPU attention paths equal the reference: the torch path (batched, cascade over shared
prefixes) and the compiled kernel (the same groups, read in place)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from kernels import cpu_extension
from kernels.attention_metadata import AttentionMetadata
from kernels.paged_attention_cpu import paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref
from tests.unit.kernel_cases import (
    ATOL,
    CASES,
    FEATURES,
    SLIDING_WINDOWS,
    AttentionCase,
    make_case,
    make_named_case,
    naive_attention,
    naive_store,
)

BLOCK_SIZE = 4


@pytest.fixture(params=[False, True], ids=["torch", "kernel"])
def use_kernel(request) -> bool:
    if request.param:
        require_kernel()
    return request.param


def require_kernel() -> None:
    """The compiled kernel must build wherever a C++ compiler is installed."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the engine uses the torch path")
    assert cpu_extension.available(), "the CPU attention kernel failed to build (see the log)"


def make_batch(rng: random.Random, num_groups: int, shared: bool, num_blocks: int = 400):
    """Requests in groups that share leading blocks (like n samples of one prompt)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables = [], [], []
    for _ in range(num_groups):
        prefix_blocks = [free.pop() for _ in range(rng.randint(0, 6))] if shared else []
        for _ in range(rng.randint(1, 5)):
            seq_len = len(prefix_blocks) * BLOCK_SIZE + rng.randint(1, 30)
            q_len = rng.choice([1, 1, 1, 3, 5, 20])
            q_len = min(q_len, seq_len - len(prefix_blocks) * BLOCK_SIZE) if prefix_blocks else (
                min(q_len, seq_len))
            own = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE) - len(prefix_blocks))]
            query_lens.append(q_len)
            seq_lens.append(seq_len)
            tables.append(prefix_blocks + own)
    return AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shared", [True, False])
def test_cpu_path_matches_reference(seed, shared, use_kernel):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    metadata = make_batch(rng, num_groups=6, shared=shared)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    key_cache = torch.randn(400, BLOCK_SIZE, num_kv_heads, head_dim)
    value_cache = torch.randn(400, BLOCK_SIZE, num_kv_heads, head_dim)
    query = torch.randn(sum(metadata.query_lens_cpu), num_heads, head_dim)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, 0.3)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.3, use_kernel)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plan = metadata.cache["cpu_plan", None]
    if use_kernel:
        _, _, group_shared = plan["kernel"]
        sharing = bool((group_shared > 0).any())
    else:
        sharing = plan["shared"] is not None
    assert sharing == shared, "the shared-prefix path should be exercised"


@pytest.mark.parametrize("window", [1, 5, 9, 30])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_path_honours_a_sliding_window(seed, window, use_kernel):
    # Groups sharing leading blocks, decode and verify rows and prefill chunks: windows that
    # end inside the shared prefix, inside a member's own blocks, and beyond everything.
    rng = random.Random(seed)
    torch.manual_seed(seed)
    metadata = make_batch(rng, num_groups=5, shared=True)
    key_cache, value_cache = torch.randn(2, 400, BLOCK_SIZE, 2, 8).unbind(0)
    query = torch.randn(sum(metadata.query_lens_cpu), 4, 8)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, 0.3, window)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.3, use_kernel,
                              sliding_window=window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    full = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.3, use_kernel)
    hides_keys = any(s - q + 1 > window for q, s in zip(metadata.query_lens_cpu,
                                                        metadata.seq_lens_cpu))
    assert torch.allclose(full, got) != hides_keys


def test_shared_prefix_is_used_for_sibling_decodes(use_kernel):
    # 8 decode rows over the same 5 leading blocks: one shared group.
    prefix = [10, 11, 12, 13, 14]
    tables = [prefix + [20 + i, 40 + i] for i in range(8)]
    metadata = AttentionMetadata.build([1] * 8, [27] * 8, tables, BLOCK_SIZE)
    torch.manual_seed(0)
    key_cache, value_cache = torch.randn(2, 64, BLOCK_SIZE, 2, 8).unbind(0)
    query = torch.randn(8, 4, 8)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, 0.35, use_kernel)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, 0.35)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    plan = metadata.cache["cpu_plan", None]
    if use_kernel:  # one group of all 8 rows over the 5 shared blocks
        members, group_starts, group_shared = plan["kernel"]
        assert members.tolist() == list(range(8))
        assert group_starts.tolist() == [0, 8] and group_shared.tolist() == [5]
        return
    assert plan["shared"] is not None and plan["shared"].tables.shape == (1, 5)
    assert plan["own"].tables.shape == (8, 2)  # each row gathers only its own 2 blocks


@pytest.mark.parametrize("seed", range(3))
def test_heads_major_cache_gives_the_same_store_and_attention(seed, use_kernel):
    """The engine's CPU cache is stored [Hkv, num_blocks, bs, D] behind the usual view."""
    from kernels import kv_cache_layout
    from kernels.dispatch import store_kv_cache
    from kernels.paged_attention_ref import store_kv_cache_ref

    rng = random.Random(seed)
    torch.manual_seed(seed)
    metadata = make_batch(rng, num_groups=5, shared=True)
    layout = kv_cache_layout(torch.device("cpu"))
    assert layout.heads_major
    dims = {"num_layers": 1, "num_blocks": 400, "block_size": BLOCK_SIZE, "num_kv_heads": 2,
            "head_dim": 8}
    storage = torch.zeros(layout.storage_shape(**dims))
    heads_major = layout.logical_view(storage)[0]  # [2, N, bs, Hkv, D]
    plain = torch.zeros(kv_cache_layout(torch.device("cuda")).storage_shape(**dims))[0]
    assert heads_major.shape == plain.shape and not heads_major.is_contiguous()
    num_tokens = sum(metadata.query_lens_cpu)
    key, value = torch.randn(2, num_tokens, 2, 8).unbind(0)
    store_kv_cache(key, value, heads_major[0], heads_major[1], metadata.slot_mapping)
    store_kv_cache_ref(key, value, plain[0], plain[1], metadata.slot_mapping)
    torch.testing.assert_close(heads_major, plain, rtol=0, atol=0)
    query = torch.randn(num_tokens, 4, 8)
    got = paged_attention_cpu(query, heads_major[0], heads_major[1], metadata, 0.3, use_kernel)
    expected = paged_attention_ref(query, plain[0], plain[1], metadata, 0.3)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The reference itself also accepts the strided view.
    torch.testing.assert_close(
        paged_attention_ref(query, heads_major[0], heads_major[1], metadata, 0.3), expected,
        atol=1e-6, rtol=1e-6,
    )


# ---- the compiled kernel on its own ----------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_dim", [None, 64, 128])
def test_kernel_matches_naive_attention(name, head_dim):
    """Short queries through the kernel, prefill chunks through torch: both against float64.

    head_dim 64 and 128 take the kernel's unrolled paths, the cases' own sizes the generic one.
    """
    require_kernel()
    case = make_named_case(name, **({"head_dim": head_dim} if head_dim else {}))
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, use_kernel=True)
    assert case.metadata.cache["cpu_plan", None]["kernel"] is not None
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[torch.float32], f"{name}: max error {err}"


@pytest.mark.parametrize("window", SLIDING_WINDOWS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_dim", [None, 64])
def test_kernel_matches_naive_attention_with_a_sliding_window(name, head_dim, window):
    require_kernel()
    case = make_named_case(name, sliding_window=window,
                           **({"head_dim": head_dim} if head_dim else {}))
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, use_kernel=True, sliding_window=window)
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[torch.float32], f"{name}, window {window}: max error {err}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision(dtype, head_dim):
    """The vectorised paths in 16-bit dtypes (bfloat16's scores on vdpbf16ps where the CPU
    has AVX512_BF16)."""
    require_kernel()
    case = make_named_case("long_decode", head_dim=head_dim).cast(dtype)
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, use_kernel=True)
    assert out.dtype == dtype
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[dtype], f"max error {err}"


def sibling_samples(rng: random.Random, block_size: int, num_blocks: int = 300):
    """Three prompts' four samples each: the prompt's blocks shared, then each sample's own with
    a partial last one; a few multi-token (draft verification) rows."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables = [], [], []
    for prompt_len in (37, 50, 33):
        prefix = [free.pop() for _ in range(-(-prompt_len // block_size))]
        for _ in range(4):
            seq_len = prompt_len + rng.randint(1, 40)
            own = [free.pop() for _ in range(-(-seq_len // block_size) - len(prefix))]
            tables.append(prefix + own)
            seq_lens.append(seq_len)
            query_lens.append(rng.choice([1, 1, 1, 3]))
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("peaked", [False, True], ids=["spread", "peaked"])
def test_kernel_on_sibling_samples(head_dim, block_size, peaked):
    """GRPO-shaped batches through the kernel's eight-lane path (head_dim 64 and 128 where the
    CPU has AVX2): groups sharing their prompt's blocks, each sample's own blocks after them with
    a partial last one, a few multi-token (draft verification) rows. Peaked: scores hundreds
    apart, so most weights underflow and the softmax is nearly one-hot."""
    require_kernel()
    metadata = sibling_samples(random.Random(head_dim + block_size), block_size)
    query_lens = metadata.query_lens_cpu
    torch.manual_seed(head_dim)
    key_cache, value_cache = torch.randn(2, 300, block_size, 2, head_dim).unbind(0)
    query = torch.randn(sum(query_lens), 4, head_dim) * (30.0 if peaked else 1.0)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, head_dim**-0.5, True)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    _, _, group_shared = metadata.cache["cpu_plan", None]["kernel"]
    assert (group_shared > 0).sum() == 3, "each prompt's samples should form a group"


def wide_groups(samples: tuple[int, ...], block_size: int, num_blocks: int = 400):
    """One prompt per entry of `samples`, with that many samples sharing its blocks (two of
    them verifying three draft tokens), each sample's own blocks after them."""
    rng = random.Random(sum(samples))
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, seq_lens, tables = [], [], []
    for n in samples:
        prompt_len = rng.randint(2 * block_size, 5 * block_size)
        prefix = [free.pop() for _ in range(prompt_len // block_size)]
        for k in range(n):
            seq_len = prompt_len + rng.randint(3, 2 * block_size)
            tables.append(prefix + [free.pop() for _ in range(-(-seq_len // block_size)
                                                                 - len(prefix))])
            seq_lens.append(seq_len)
            query_lens.append(3 if k in (1, 4) else 1)
    return AttentionMetadata.build(query_lens, seq_lens, tables, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("options", [{}, {"softcap": 2.0, "sinks": True},
                                     {"sliding_window": 70}], ids=["plain", "softcap_sinks",
                                                                   "window"])
def test_kernel_lanes_path_on_wide_groups(options, head_dim, dtype, monkeypatch):
    """Groups of 13, 9 and 4 samples over 2 query heads per KV head, members 1 and 4 verifying
    3 tokens (vectors 16 + 16 + 2, 16 + 10, 12): the shared blocks go sixteen vectors to a
    chunk on the lanes path where a chunk holds 8 or more, the rest (2) on the tiles; a
    window that begins inside a shared block sends that chunk to the tiles. Lanes on and off agree with the oracle,
    and differ from each other in the last bits (the lanes path did run)."""
    require_kernel()
    options = dict(options)
    metadata = wide_groups((13, 9, 4), block_size=16)
    gen = torch.Generator().manual_seed(head_dim)
    key_cache, value_cache = torch.randn(2, 400, 16, 2, head_dim, generator=gen).unbind(0)
    query = torch.randn(sum(metadata.query_lens_cpu), 4, head_dim, generator=gen)
    sinks = torch.randn(4, generator=gen) * 2 if options.pop("sinks", False) else None
    case = AttentionCase(query, key_cache, value_cache, metadata, head_dim**-0.5, sinks=sinks,
                         **options).cast(dtype)
    lanes = attend_cpu(case, True)
    monkeypatch.setenv("ROLLOUT_ENGINE_CPU_ATTN_LANES", "0")
    tiles = attend_cpu(case, True)
    assert_matches_naive(lanes, case, atol=2e-5 if dtype == torch.float32 else None)
    assert_matches_naive(tiles, case, atol=2e-5 if dtype == torch.float32 else None)
    _, _, group_shared = metadata.cache["cpu_plan", case.sliding_window]["kernel"]
    assert (group_shared > 0).sum() == 3, "each prompt's samples should form a group"
    # The kernel has sixteen-lane paths where it was compiled for AVX-512 (-march=native).
    if dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert not torch.equal(lanes, tiles), "the shared blocks should have taken the lanes"


@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("block_size", [32, 48])
def test_kernel_with_blocks_wider_than_a_vector(block_size, window):
    """Blocks of several sixteen-lane score vectors (the vectorised path's block loop), with
    verify rows whose tokens share a tile of query vectors but see different keys (3 heads per
    KV head: tiles of two vectors straddle tokens) and windows that start mid-block."""
    require_kernel()
    case = make_case([1, 4, 7, 1], [100, 61, 33, 7], num_heads=6, num_kv_heads=2, head_dim=64,
                     block_size=block_size, sliding_window=window)
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, use_kernel=True, sliding_window=window)
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[torch.float32], f"max error {err}"


# ---- softcap, sinks, values of their own width ---------------------------------------------


def attend_cpu(case: AttentionCase, use_kernel: bool) -> torch.Tensor:
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, use_kernel, **case.options)
    assert (case.metadata.cache["cpu_plan", case.sliding_window]["kernel"] is not None) == (
        use_kernel)
    assert out.shape == case.output_shape and out.dtype == case.query.dtype
    return out


def assert_matches_naive(out: torch.Tensor, case: AttentionCase, atol: float | None = None):
    err = (out.double() - naive_attention(case)).abs().max().item()
    atol = ATOL[case.query.dtype] if atol is None else atol
    assert err <= atol, f"max error {err} > {atol}"


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_path_with_softcap_sinks_and_value_widths(name, feature, use_kernel):
    """Both paths for the short queries (prefill chunks through torch's explicit path), the
    cases' own head dims: the kernel's portable loops."""
    case = make_named_case(name, **FEATURES[feature])
    assert_matches_naive(attend_cpu(case, use_kernel), case)


# Combinations on sibling samples: softcap, sinks, both with a window, and values narrower and
# wider than keys (24/16, 16/40) with everything.
SIBLING_OPTIONS = {
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "softcap_sinks_window": {"softcap": 2.0, "sinks": True, "sliding_window": 9},
    "dk24_dv16": {"head_dim": 24, "value_head_dim": 16, "softcap": 2.0, "sinks": True},
    "dk16_dv40_window": {"value_head_dim": 40, "sinks": True, "softcap": 1.0,
                         "sliding_window": 30},
}


def sibling_case(seed: int, options: dict, head_dim: int = 16, block_size: int = BLOCK_SIZE,
                 num_heads: int = 4, num_kv_heads: int = 2) -> AttentionCase:
    """`make_case`'s options on `make_batch`'s groups of requests sharing leading blocks."""
    options = dict(options)
    rng = random.Random(seed)
    metadata = (make_batch(rng, num_groups=5, shared=True) if block_size == BLOCK_SIZE
                else sibling_samples(rng, block_size))
    gen = torch.Generator().manual_seed(seed)
    head_dim = options.pop("head_dim", head_dim)
    value_dim = options.pop("value_head_dim", None) or head_dim
    key_cache = torch.randn(400, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(400, block_size, num_kv_heads, value_dim, generator=gen)
    query = torch.randn(sum(metadata.query_lens_cpu), num_heads, head_dim, generator=gen)
    sinks = torch.randn(num_heads, generator=gen) * 2 if options.pop("sinks", False) else None
    return AttentionCase(query, key_cache, value_cache, metadata, head_dim**-0.5,
                         sinks=sinks, **options)


@pytest.mark.parametrize("options", list(SIBLING_OPTIONS))
@pytest.mark.parametrize("seed", range(2))
def test_cpu_path_with_features_on_shared_prefixes(seed, options, use_kernel):
    """Cascade: groups attend to their shared blocks together (the torch path merges the two
    parts with their log-sum-exps, then adds the sinks once; the kernel carries one state)."""
    case = sibling_case(seed, SIBLING_OPTIONS[options])
    assert_matches_naive(attend_cpu(case, use_kernel), case)
    plan = case.metadata.cache["cpu_plan", case.sliding_window]
    if use_kernel:
        assert (plan["kernel"][2] > 0).any(), "the kernel should share prefixes"
    elif not case.sliding_window:
        assert plan["shared"] is not None, "the torch path should share prefixes"


@pytest.mark.parametrize("options", ["softcap", "sinks", "softcap_sinks_window"])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_vectorised_paths_with_softcap_and_sinks(head_dim, block_size, options):
    """head_dim 64 and 128 (the eight- and sixteen-lane paths where the CPU has them) on GRPO-
    shaped batches: shared prompt blocks, partial blocks, verify rows."""
    require_kernel()
    case = sibling_case(head_dim + block_size, SIBLING_OPTIONS[options], head_dim=head_dim,
                        block_size=block_size)
    assert_matches_naive(attend_cpu(case, True), case, atol=2e-5)


@pytest.mark.parametrize("sink", [-30.0, 0.0, 12.0, 200.0])
@pytest.mark.parametrize("head_dim", [64, 16])
def test_kernel_with_sinks_far_from_the_scores(head_dim, sink):
    """Sinks that hardly count, that take most of the weight (the output nearly 0) and that
    dwarf every score (the running maximum starts at the sink and never moves), on peaked
    scores (the first blocks' weights underflow)."""
    require_kernel()
    case = sibling_case(7, {}, head_dim=head_dim, block_size=16)
    case.query = case.query * 8.0
    case.sinks = torch.full((case.query.shape[1],), sink)
    assert_matches_naive(attend_cpu(case, True), case, atol=2e-5)


@pytest.mark.parametrize("dims", [(24, 16), (16, 40), (64, 128), (128, 64), (192, 128)],
                         ids=lambda d: f"dk{d[0]}-dv{d[1]}")
def test_cpu_path_with_values_of_their_own_width(dims, use_kernel):
    """Key and value widths that differ (multi-head latent attention is 192/128) take the
    kernel's portable loops, whatever the widths."""
    head_dim, value_dim = dims
    case = make_case([1, 3, 1, 20], [40, 19, 7, 29], num_heads=4, num_kv_heads=2,
                     head_dim=head_dim, value_head_dim=value_dim, block_size=8, sinks=True,
                     softcap=3.0, seed=head_dim + value_dim)
    assert_matches_naive(attend_cpu(case, use_kernel), case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [None, 64])
def test_cpu_path_half_precision_with_every_feature(dtype, head_dim, use_kernel):
    options = dict(FEATURES["all"])
    if head_dim:  # values as wide: the vectorised paths
        options.pop("value_head_dim")
        options["head_dim"] = head_dim
    case = make_named_case("long_decode", **options).cast(dtype)
    assert_matches_naive(attend_cpu(case, use_kernel), case)


def test_store_with_values_of_their_own_width_in_heads_major_storage(monkeypatch, use_kernel):
    """The engine's CPU caches: key and value each a permuted view of a contiguous
    [Hkv, num_blocks, bs, D] tensor of its own width. The fast store (no fallback) writes
    exactly the reference's slots, and attention reads them in place."""
    import kernels.paged_attention_cpu as cpu
    from kernels.dispatch import store_kv_cache

    def no_fallback(*_args):
        raise AssertionError("the heads-major store should not fall back")

    monkeypatch.setattr(cpu, "store_kv_cache_ref", no_fallback)
    metadata = make_batch(random.Random(4), num_groups=4, shared=True)
    num_kv_heads, head_dim, value_dim = 2, 24, 16
    key_cache = torch.zeros(num_kv_heads, 400, BLOCK_SIZE, head_dim).permute(1, 2, 0, 3)
    value_cache = torch.zeros(num_kv_heads, 400, BLOCK_SIZE, value_dim).permute(1, 2, 0, 3)
    plain_k, plain_v = key_cache.contiguous(), value_cache.contiguous()
    num_tokens = sum(metadata.query_lens_cpu)
    key = torch.randn(num_tokens, num_kv_heads, head_dim)
    value = torch.randn(num_tokens, num_kv_heads, value_dim)
    store_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
    naive_store(key, value, plain_k, plain_v, metadata.slot_mapping)
    assert torch.equal(key_cache, plain_k) and torch.equal(value_cache, plain_v)
    case = AttentionCase(torch.randn(num_tokens, 4, head_dim), key_cache, value_cache, metadata,
                         0.3, softcap=2.0, sinks=torch.randn(4))
    assert_matches_naive(attend_cpu(case, use_kernel), case)


def test_kernel_keeps_its_old_call_and_refuses_bad_new_arguments():
    require_kernel()
    case = make_case([1, 1], [13, 13], head_dim=16, value_head_dim=8, seed=3)
    args = _kernel_args(case, [0, 1], [0, 2], [0])
    out = torch.zeros(case.output_shape)
    # The op's old positional form: no softcap, no sinks.
    torch.ops.rollout_cpu.paged_attention_short(*args, 0, out)
    torch.testing.assert_close(out, naive_attention(case).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match=r"out must be \[T, H, value_head_dim\]"):
        cpu_extension.paged_attention_short(*args, torch.zeros_like(case.query))
    with pytest.raises(RuntimeError, match="sinks must be"):
        cpu_extension.paged_attention_short(*args, out, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="softcap must be"):
        cpu_extension.paged_attention_short(*args, out, softcap=-1.0)
    bad_values = torch.zeros(case.value_cache.shape[0] + 1, *case.value_cache.shape[1:])
    with pytest.raises(RuntimeError, match="caches differ in shape"):
        cpu_extension.paged_attention_short(*[*args[:2], bad_values, *args[3:]], out)


def _kernel_args(case, members, group_starts, group_shared):
    md = case.metadata
    return [case.query, case.key_cache, case.value_cache, md.block_tables, md.seq_lens,
            md.query_start_loc, torch.tensor(members), torch.tensor(group_starts),
            torch.tensor(group_shared), case.scale]


def test_kernel_leaves_rows_of_unlisted_requests_alone():
    require_kernel()
    case = make_case([1, 1, 1], [9, 14, 5])
    out = torch.full_like(case.query, 7.0)
    cpu_extension.paged_attention_short(*_kernel_args(case, [1], [0, 1], [0]), out)
    assert (out[0] == 7.0).all() and (out[2] == 7.0).all()
    expected = naive_attention(case).float()
    torch.testing.assert_close(out[1], expected[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (lambda a: a.__setitem__(3, torch.tensor([[0, 1, 2, 10_000], [3, 4, 5, 6]], dtype=torch.int32)),
     "block id out of range"),
    (lambda a: a.__setitem__(6, torch.tensor([0, 5])), "request index out of range"),
    (lambda a: a.__setitem__(8, torch.tensor([4])), "shared prefix must end before"),
    (lambda a: a.__setitem__(3, a[3].long()), "int32"),
    (lambda a: a.__setitem__(1, a[1].double()), "share a dtype"),
    (lambda a: a.__setitem__(4, torch.tensor([13, 100], dtype=torch.int32)),
     "exceeds its block table"),
])
def test_kernel_refuses_indices_it_would_read_out_of_bounds(bad, message):
    """Every index is checked before any is followed: a clear error, never a wild read."""
    require_kernel()
    case = make_case([1, 1], [13, 13], block_size=4)
    args = _kernel_args(case, [0, 1], [0, 2], [0])
    bad(args)
    out = torch.zeros_like(case.query)
    with pytest.raises(RuntimeError, match=message):
        cpu_extension.paged_attention_short(*args, out)


def test_kernel_refuses_a_shared_prefix_the_members_do_not_share():
    require_kernel()
    case = make_case([1, 1], [13, 13], block_size=4)  # distinct blocks: nothing shared
    with pytest.raises(RuntimeError, match="shared block differs"):
        cpu_extension.paged_attention_short(*_kernel_args(case, [0, 1], [0, 2], [2]),
                                            torch.zeros_like(case.query))


def test_switched_off_kernel_leaves_the_torch_path(monkeypatch):
    """ROLLOUT_ENGINE_CPU_KERNEL=0 is the way back to the torch path (and what a machine
    without a compiler gets)."""
    monkeypatch.setenv("ROLLOUT_ENGINE_CPU_KERNEL", "0")
    assert not cpu_extension.available()
    case = make_named_case("long_decode")
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale)
    assert case.metadata.cache["cpu_plan", None]["kernel"] is None
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[torch.float32]


def test_a_failed_build_leaves_the_torch_path_with_a_warning(monkeypatch, caplog):
    """A machine whose compiler fails (or is missing) keeps serving on the torch path."""
    from torch.utils import cpp_extension

    def broken_build(**_kwargs):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", broken_build)
    with caplog.at_level("WARNING", logger="kernels.cpu_extension"):
        assert cpu_extension._load() is False
    assert "using the torch path" in caplog.text and "command not found" in caplog.text
