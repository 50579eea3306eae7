"""The batch-invariant linear layer: a row's bits do not depend on the batch around it, its
place in it or the thread count; it stays accurate; its gradients are right; the mode routes a
Hugging Face model's linear layers to it in the thread that entered it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rollout_engine.batch_invariant import (
    attention,
    drop_packed_weights,
    grouped_mm,
    is_batch_invariant_mode_enabled,
    linear,
    packed_weights_bytes,
    set_batch_invariant_mode,
)
from rollout_engine.worker.weights.loader import cpu_computes_bf16
from tests.unit.test_paged_attention_cpu import require_kernel

SHAPES = [(64, 128), (100, 37), (512, 1536), (1000, 3)]  # (K, N): K off the 16-lane groups too


@pytest.fixture(autouse=True)
def kernel() -> None:
    require_kernel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_a_row_has_the_same_bits_alone_in_any_batch_and_with_any_thread_count(dtype, k, n):
    generator = torch.Generator().manual_seed(k * n)
    x = torch.randn(70, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    full = linear(x, weight, bias)
    for row in (0, 3, 15, 16, 31, 32, 41, 69):  # AMX tiles: 16 rows, pairs of 32
        assert torch.equal(linear(x[row:row + 1], weight, bias), full[row:row + 1])
    order = torch.randperm(70, generator=generator)
    assert torch.equal(linear(x[order], weight, bias), full[order])
    assert torch.equal(linear(x[5:38], weight, bias), full[5:38])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, weight, bias), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("dtype", "tolerance"),
                         [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
def test_it_computes_the_linear_layer(dtype, tolerance):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 9, 200, generator=generator).to(dtype)  # leading dims kept
    weight = torch.randn(300, 200, generator=generator).to(dtype) / 200 ** 0.5
    bias = torch.randn(300, generator=generator).to(dtype)
    out = linear(x, weight, bias)
    assert out.shape == (3, 9, 300) and out.dtype == dtype
    exact = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), exact, rtol=tolerance, atol=tolerance)
    no_bias = linear(x, weight)
    torch.testing.assert_close(no_bias.double(), exact - bias.double(), rtol=tolerance,
                               atol=tolerance)


def _pair_chain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                pairs: range) -> torch.Tensor:
    """Each output as a float32 chain over the k pairs in the order given (each bfloat16
    product is exact in float32, so `acc + x * w` rounds once, as the instruction does)."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for i in pairs:
        for k in (2 * i + 1, 2 * i):  # the odd product first, then the even one
            if k < x.shape[1]:
                acc = acc + xf[:, k, None] * wf[None, :, k]
    return (acc + bias.float()).to(torch.bfloat16)


@pytest.mark.skipif(not cpu_computes_bf16() or torch.cpu._is_amx_tile_supported()
                    or os.environ.get("ROLLOUT_ENGINE_BI_DPBF16") == "0",
                    reason="needs AVX512_BF16 without AMX (AMX tiles go first)")
def test_bfloat16_is_one_pair_dot_product_chain_per_output_on_avx512_bf16():
    """Where the CPU has AVX512_BF16, bfloat16 weights are packed in k pairs and each output is
    vdpbf16ps's chain over the pairs in increasing order: the bits of that chain, which a
    different order of the same pairs does not give."""
    from kernels import cpu_extension
    generator = torch.Generator().manual_seed(5)
    x, weight, bias = (torch.randn(*shape, generator=generator).to(torch.bfloat16)
                       for shape in ((12, 1001), (40, 1001), (40,)))
    # The second half of k cancels the first: what is left is the chain's rounding, which
    # depends on the order (a sum of random terms hides it under the bfloat16 rounding).
    x[:, 500:1000], weight[:, 500:1000], bias = x[:, :500], -weight[:, :500], bias * 1e-3
    assert cpu_extension.batch_invariant_pack(weight).shape == (3, 501, 16, 2)  # K odd: a zero
    out = linear(x, weight, bias)
    assert torch.equal(out, _pair_chain(x, weight, bias, range(501)))
    assert not torch.equal(out, _pair_chain(x, weight, bias, range(500, -1, -1)))


def test_gradients_are_right():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 19, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(7, 19, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(linear, (x, weight, bias))
    assert torch.autograd.gradcheck(lambda a, w: linear(a, w), (x, weight))


def test_packed_copies_are_reused_only_where_the_caller_owns_the_weights_changes():
    """With `reuse_packed_weights` (the engine) a weight is packed once and packed again when
    torch sees it change; a write behind torch's back (`.data`) takes effect after
    `drop_packed_weights()`; without reuse (a trainer) every call reads the weight as it is.
    A collected weight's copy goes with it."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 24, generator=generator)
    x = torch.randn(3, 24, generator=generator)
    new = torch.randn(40, 24, generator=generator)
    drop_packed_weights()
    with set_batch_invariant_mode(reuse_packed_weights=True):
        before = linear(x, weight)
        assert packed_weights_bytes() == 48 * 24 * 4  # 40 columns padded to 3 panels of 16
        with torch.no_grad():
            weight.copy_(new)  # torch sees it: packed again
        assert torch.equal(linear(x, weight), linear(x, new))
        weight.data.copy_(torch.zeros_like(weight))  # behind torch's back
        assert torch.equal(linear(x, weight), linear(x, new))  # the stale copy, by contract
        drop_packed_weights()
        assert torch.equal(linear(x, weight), torch.zeros(3, 40))
    weight.data.copy_(new)
    assert torch.equal(linear(x, weight), linear(x, new))  # without reuse: read every call
    assert not torch.equal(before, linear(x, new))
    with set_batch_invariant_mode(reuse_packed_weights=True):
        linear(x, weight)
    assert packed_weights_bytes() > 0
    del weight
    assert packed_weights_bytes() == 0


def test_grouped_mm_runs_each_experts_rows_through_its_weights():
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(10, 24, generator=generator)
    experts = torch.randn(3, 24, 8, generator=generator)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)  # expert 1 has no rows; row 9 none
    out = grouped_mm(rows, experts, offs=offs)
    expected = torch.cat([rows[:4] @ experts[0], rows[4:9] @ experts[2], torch.zeros(1, 8)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped_mm(rows[4:9], experts, offs=torch.tensor([0, 0, 5])), out[4:9])
    with set_batch_invariant_mode():
        assert torch.equal(torch._grouped_mm(rows, experts, offs=offs), out)


def _scores_on_pairs() -> bool:
    """Whether bfloat16 attention scores run on vdpbf16ps here (head dims of whole 32s)."""
    return cpu_computes_bf16() and os.environ.get("ROLLOUT_ENGINE_BI_DPBF16") != "0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_is_sdpa_with_each_querys_bits_fixed_by_its_visible_keys(dtype):
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 40, 32, generator=generator).to(dtype)
    k = torch.randn(2, 2, 40, 32, generator=generator).to(dtype)  # grouped-query: 2 per head
    v = torch.randn(2, 2, 40, 32, generator=generator).to(dtype)
    causal = attention(q, k, v, is_causal=True)
    reference = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                               v.float().repeat_interleave(2, 1), is_causal=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(causal.float(), reference, rtol=tolerance, atol=tolerance)
    # The same queries with keys cut after them, or left-padded by 7, or one query alone.
    assert torch.equal(attention(q[:, :, :25], k[:, :, :25], v[:, :, :25], is_causal=True),
                       causal[:, :, :25])
    pad = torch.zeros(2, 2, 7, 32, dtype=dtype)
    visible = torch.ones(47, 47, dtype=torch.bool).tril()
    visible[:, :7] = False
    left = attention(torch.cat([torch.zeros(2, 4, 7, 32, dtype=dtype), q], 2),
                     torch.cat([pad, k], 2), torch.cat([pad, v], 2), attn_mask=visible)
    assert torch.equal(left[:, :, 7:], causal)
    assert torch.equal(left[:, :, :7], torch.zeros_like(left[:, :, :7]))  # sees nothing
    additive = torch.zeros(47, 47, dtype=dtype).masked_fill(~visible, float("-inf"))
    assert torch.equal(attention(torch.cat([torch.zeros(2, 4, 7, 32, dtype=dtype), q], 2),
                                 torch.cat([pad, k], 2), torch.cat([pad, v], 2),
                                 attn_mask=additive), left)
    assert torch.equal(attention(q[1:, :, 30:31], k[1:, :, :31], v[1:, :, :31]),
                       causal[1:, :, 30:31])
    # A mask with a hole (key 12 hidden from every query): the bits of the same keys without it.
    holed = torch.ones(40, 40, dtype=torch.bool).tril()
    holed[:, 12] = False
    kept = [j for j in range(40) if j != 12]
    assert torch.equal(attention(q, k, v, attn_mask=holed)[:, :, kept],
                       attention(q[:, :, kept], k[:, :, kept], v[:, :, kept], is_causal=True))
    # float32 math on the widened values, rounded at the end; where the CPU has AVX512_BF16 the
    # scores add pairs of exact products instead (the widened order with it off: the slow
    # vector-width test)
    if dtype == torch.bfloat16 and not _scores_on_pairs():
        assert torch.equal(attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype),
                           causal)
    # A mask of its own per head: each query head alone instead of with its key/value head's
    # other queries; the same bits.
    per_head = visible.expand(2, 4, 47, 47).contiguous()
    assert torch.equal(attention(torch.cat([torch.zeros(2, 4, 7, 32, dtype=dtype), q], 2),
                                 torch.cat([pad, k], 2), torch.cat([pad, v], 2),
                                 attn_mask=per_head), left)


def test_attention_gradients_are_sdpas():
    generator = torch.Generator().manual_seed(6)
    inputs = [torch.randn(1, 2, 9, 16, generator=generator, requires_grad=True)
              for _ in range(3)]
    attention(*inputs, is_causal=True).square().sum().backward()
    ours = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    F.scaled_dot_product_attention(*inputs, is_causal=True).square().sum().backward()
    for grad, t in zip(ours, inputs, strict=True):
        torch.testing.assert_close(grad, t.grad, rtol=1e-4, atol=1e-5)
    # Left padding: the pad queries see no key (output 0, no gradient), the rest as float64 math.
    visible = torch.ones(9, 9, dtype=torch.bool).tril()
    visible[:, :3] = False
    for t in inputs:
        t.grad = None
    attention(*inputs, attn_mask=visible).square().sum().backward()
    ours = [t.grad.clone() for t in inputs]
    wide = [t.detach().double().requires_grad_() for t in inputs]
    scores = (wide[0] @ wide[1].transpose(-1, -2) / 4).masked_fill(~visible, float("-inf"))
    (torch.softmax(scores, -1).nan_to_num(0.0) @ wide[2]).square().sum().backward()
    for grad, t in zip(ours, wide, strict=True):
        torch.testing.assert_close(grad.double(), t.grad, rtol=1e-4, atol=1e-5)


def test_the_backward_takes_the_kernels_log_sum_exp_grouped_heads_and_bf16():
    """The CPU backward is sdpa's flash backward given our output and log-sum-exp: the
    log-sum-exp is the scores' (0 where a query sees no key), and grouped heads in bf16 get
    gradients as close to float64 math as sdpa's own."""
    from kernels import cpu_extension
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 12, 16, generator=generator)
    k, v = (torch.randn(2, 2, 12, 16, generator=generator) for _ in range(2))
    visible = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    visible[0, :, :, :5] = False  # row 0 left-padded: its first 5 queries see no key
    _, lse = cpu_extension.batch_invariant_attention_lse(q, k, v, visible, False, 0.25)
    wide = [t.double().repeat_interleave(r, 1) for t, r in ((q, 1), (k, 2), (v, 2))]
    scores = (wide[0] @ wide[1].transpose(-1, -2) * 0.25).masked_fill(~visible, float("-inf"))
    expected = torch.logsumexp(scores, -1).nan_to_num(0.0, neginf=0.0)
    torch.testing.assert_close(lse.double(), expected, rtol=1e-5, atol=1e-5)
    assert (lse[0, :, :5] == 0).all()

    inputs = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn(2, 4, 12, 16, generator=generator).bfloat16()
    ours = torch.autograd.grad(attention(*inputs, attn_mask=visible, scale=0.25,
                                         enable_gqa=True), inputs, grad_out)
    torchs = torch.autograd.grad(F.scaled_dot_product_attention(
        *inputs, attn_mask=visible, scale=0.25, enable_gqa=True), inputs, grad_out)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    scores = (wide[0] @ wide[1].repeat_interleave(2, 1).transpose(-1, -2) * 0.25)
    out = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    exact = torch.autograd.grad(out @ wide[2].repeat_interleave(2, 1), wide, grad_out.double())
    for mine, theirs, truth in zip(ours, torchs, exact, strict=True):
        error, sdpa_error = ((g.double() - truth).abs().max() for g in (mine, theirs))
        assert error <= 2 * sdpa_error + 1e-3, (error, sdpa_error)


def test_attention_refuses_what_it_cannot_keep_invariant():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="dropout"):
        attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="0 and -inf"):
        attention(q, q, q, attn_mask=torch.randn(4, 4))  # a bias (ALiBi-like)
    with pytest.raises(ValueError, match="not both"):
        attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        attention(q, torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16))


def test_shapes_that_do_not_fit_are_refused():
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        linear(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64))


def test_the_mode_routes_every_linear_layer_of_the_thread_that_entered_it():
    layer = torch.nn.Linear(40, 30)
    x = torch.randn(6, 40)
    with torch.no_grad():
        expected = linear(x, layer.weight, layer.bias)
        assert not is_batch_invariant_mode_enabled()
        with set_batch_invariant_mode():
            assert is_batch_invariant_mode_enabled()
            assert torch.equal(layer(x), expected)
            with set_batch_invariant_mode(False):  # a flag passed through: no change
                assert torch.equal(layer(x), expected)
            seen = []
            other = threading.Thread(target=lambda: seen.append(is_batch_invariant_mode_enabled()))
            other.start()
            other.join()
            assert seen == [False]
        assert not is_batch_invariant_mode_enabled()
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_training_through_the_mode_gets_the_plain_gradients():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.SiLU(), torch.nn.Linear(48, 5))
    x = torch.randn(11, 24)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with set_batch_invariant_mode():
        model(x).square().sum().backward()
    for grad, expected in zip((p.grad for p in model.parameters()), plain, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


_VARIANT = """
import sys, torch
from torch.utils import cpp_extension
name, out, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
if name == "native":
    from kernels import cpu_extension
    assert cpu_extension.available()
else:
    cpp_extension.load(name=name, sources=["kernels/csrc/batch_invariant_cpu.cpp",
                                           "kernels/csrc/batch_invariant_attention_cpu.cpp"],
                       extra_cflags=flags + ["-fopenmp"], extra_ldflags=["-fopenmp"],
                       is_python_module=False)
generator = torch.Generator().manual_seed(0)
outs = []
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    x, w, b = (torch.randn(*shape, generator=generator).to(dtype)
               for shape in ((37, 203), (45, 203), (45,)))
    outs.append(torch.ops.rollout_cpu.batch_invariant_linear(x, w, b))
    if dtype != torch.float64:  # attention, its exp included: scores far apart and close
        for head_dim in (24, 64):  # 64: whole vectors, sixteen keys' dot products at once
            q, k, v = (torch.randn(2, 4, 40, head_dim, generator=generator).to(dtype) * 3
                       for _ in range(3))
            outs.append(torch.ops.rollout_cpu.batch_invariant_attention(q, k, v, None, True,
                                                                        0.2))
torch.save(outs, out)
"""


@pytest.mark.slow
def test_the_bits_do_not_depend_on_the_vector_width(tmp_path):
    """The AVX-512 build (this machine's -march=native), an AVX2 build and the portable loops
    follow one order: their linear layers and attention (its exp included) are equal, bit for
    bit (each variant builds in its own process). AMX tiles and AVX512_BF16's pair dot product,
    which round bfloat16 sums their own way, are off here; the other tests run them where the
    CPU has them."""
    root = Path(__file__).resolve().parents[2]
    variants = {"native": [], "bi_test_avx2": ["-O2", "-mavx2", "-mfma", "-mf16c"],
                "bi_test_portable": ["-O2"]}
    results = {}
    for name, flags in variants.items():
        out = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _VARIANT, name, str(out), *flags], cwd=root,
                       check=True, timeout=300, env={**os.environ, "ROLLOUT_ENGINE_BI_AMX": "0",
                                                    "ROLLOUT_ENGINE_BI_DPBF16": "0"})
        results[name] = torch.load(out)
    for name in variants:
        assert all(torch.equal(a, b) for a, b in zip(results["native"], results[name],
                                                       strict=True)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 4, 24])
def test_paged_attention_reads_shared_prefixes_once_with_each_tokens_bits(dtype, block_size):
    """Decode tokens whose block tables begin with the same blocks (a prompt's samples) attend
    to those keys together: every output equals, bit for bit, the same token's with its own
    copies of the blocks, and the dense kernel's over its keys (members of other lengths, one
    sharing less, prefill rows and a padding row in the step)."""
    require_kernel()
    generator = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    prefix_blocks = 80 // block_size  # whole blocks of a shared 80-token prompt
    lens = [83, 97, 81, 90, 40, 7]  # four samples of the prompt, a prefill of 5, a short one
    q_lens = [1, 1, 1, 1, 5, 1]
    shared_tables, copied_tables, next_block = [], [], 0

    def blocks(count: int) -> list[int]:
        nonlocal next_block
        next_block += count
        return list(range(next_block - count, next_block))

    prompt = blocks(prefix_blocks)
    for i, length in enumerate(lens):
        total = -(-length // block_size)
        if i < 4:  # the samples: the prompt's blocks (the third keeps only half of them)
            keep = prefix_blocks if i != 2 else prefix_blocks // 2
            own = blocks(total - keep)
            shared_tables.append(prompt[:keep] + own)
            copied_tables.append(blocks(keep) + own)
        else:
            table = blocks(total)
            shared_tables.append(table)
            copied_tables.append(table)
    width = max(map(len, shared_tables))
    shape = (next_block, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    for shared, copied in zip(shared_tables, copied_tables):  # copies hold the same keys
        key_cache[copied] = key_cache[shared]
        value_cache[copied] = value_cache[shared]

    def as_tensor(tables):
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    num_tokens = sum(q_lens) + 1  # a padding row last
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    outs = [torch.ops.rollout_cpu.batch_invariant_paged_attention(
        query, key_cache, value_cache, as_tensor(tables), seq_lens, starts, 0.125, 0)
        for tables in (shared_tables, copied_tables)]
    assert torch.equal(outs[0], outs[1])
    assert not outs[0][-1].any()  # the padding row
    for r, (table, length) in enumerate(zip(shared_tables, lens)):  # the dense kernel's bits
        slots = torch.tensor([table[j // block_size] * block_size + j % block_size
                              for j in range(length)])
        keys = key_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
        values = value_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
        rows = query[starts[r]:starts[r + 1]].transpose(0, 1)[None]
        mask = torch.ones(q_lens[r], length, dtype=torch.bool).tril(length - q_lens[r])
        dense = torch.ops.rollout_cpu.batch_invariant_attention(
            rows, keys, values, mask, False, 0.125)
        assert torch.equal(outs[0][starts[r]:starts[r + 1]], dense[0].transpose(0, 1)), r
