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
    SLIDING_WINDOWS,
    make_case,
    make_named_case,
    naive_attention,
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision(dtype):
    require_kernel()
    case = make_named_case("long_decode", head_dim=64).cast(dtype)
    out = paged_attention_cpu(case.query, case.key_cache, case.value_cache, case.metadata,
                              case.scale, use_kernel=True)
    assert out.dtype == dtype
    err = (out.double() - naive_attention(case)).abs().max().item()
    assert err <= ATOL[dtype], f"max error {err}"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("peaked", [False, True], ids=["spread", "peaked"])
def test_kernel_on_sibling_samples(head_dim, block_size, peaked):
    """GRPO-shaped batches through the kernel's eight-lane path (head_dim 64 and 128 where the
    CPU has AVX2): groups sharing their prompt's blocks, each sample's own blocks after them with
    a partial last one, a few multi-token (draft verification) rows. Peaked: scores hundreds
    apart, so most weights underflow and the softmax is nearly one-hot."""
    require_kernel()
    rng = random.Random(head_dim + block_size)
    free = list(range(300))
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
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    torch.manual_seed(head_dim)
    key_cache, value_cache = torch.randn(2, 300, block_size, 2, head_dim).unbind(0)
    query = torch.randn(sum(query_lens), 4, head_dim) * (30.0 if peaked else 1.0)
    got = paged_attention_cpu(query, key_cache, value_cache, metadata, head_dim**-0.5, True)
    expected = paged_attention_ref(query, key_cache, value_cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    _, _, group_shared = metadata.cache["cpu_plan", None]["kernel"]
    assert (group_shared > 0).sum() == 3, "each prompt's samples should form a group"


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
