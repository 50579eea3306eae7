"""The CUDA side of batch invariance (`kernels/triton_batch_invariant.py`), run by Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1, ROLLOUT_ENGINE_BI_TRITON=1 routes the mode's ops
there): a row's bits do not depend on the other rows, a token's attention output is the same
decoded alone, in any prefill chunk or batch, and a trainer's padded sdpa call through the same
kernel equals the engine's paged one; end to end, a Hugging Face model under
`set_batch_invariant_mode()` and the engine agree bit for bit. The interpreter shows the order of
operations is fixed; that a GPU's MMA keeps a row's bits whatever its neighbours is what
`scripts/gpu_check.sh` checks on a GPU. The oracle is `==`."""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.attention_metadata import AttentionMetadata
from tests.unit.kernel_cases import ATOL, make_case, naive_attention
from tests.unit.test_kernels_triton import triton_language_use

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton)")

TRITON_MODULES = ("kernels.triton_utils", "kernels.triton_paged_attention",
                  "kernels.triton_batch_invariant")


@pytest.fixture(scope="module")
def tbi():
    """Fresh imports with the interpreter on (`triton.jit` decides at definition), dropped
    afterwards so that later imports compile real kernels."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("ROLLOUT_ENGINE_BI_TRITON", "1")
        for name in TRITON_MODULES:
            mp.delitem(sys.modules, name, raising=False)
            mp.delattr(kernels, name.rpartition(".")[2], raising=False)
        yield importlib.import_module("kernels.triton_batch_invariant")
        for name in TRITON_MODULES:
            sys.modules.pop(name, None)
            if hasattr(kernels, name.rpartition(".")[2]):
                delattr(kernels, name.rpartition(".")[2])


def test_the_kernels_call_only_triton_builtins(tbi):
    used, jit_helpers = triton_language_use(tbi)
    assert {"dot", "reduce", "exp", "log"} <= used
    assert not jit_helpers, f"kernels call triton.language jit helpers: {jit_helpers}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_rows_bits_do_not_depend_on_the_batch(tbi, dtype):
    gen = torch.Generator().manual_seed(0)
    k, n = 100, 70  # neither a whole number of tiles
    x = torch.randn(130, k, generator=gen).to(dtype)
    weight = torch.randn(k, n, generator=gen).to(dtype).t()  # a strided [N, K] view
    bias = torch.randn(n, generator=gen).to(dtype)
    full = tbi.linear(x, weight, bias)
    for rows in (slice(0, 1), slice(7, 8), slice(63, 66), slice(100, 130)):
        assert torch.equal(tbi.linear(x[rows], weight, bias), full[rows]), rows
    torch.testing.assert_close(full.float(), F.linear(x.float(), weight.float(), bias.float()),
                               atol=1e-4 if dtype == torch.float32 else 0.2, rtol=1e-2)


def test_row_reductions_do_not_depend_on_the_batch_and_compute_torchs(tbi):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2500, generator=gen) * 4  # rows of three pieces, the last one partial
    x[3, 100:2000] = float("-inf")  # masked logits
    ops = {"mean": (lambda t: tbi.mean_last_dim(t, keepdim=True),
                    lambda t: t.mean(-1, keepdim=True)),
           "log_softmax": (tbi.log_softmax, lambda t: t.log_softmax(-1)),
           "softmax": (tbi.softmax, lambda t: t.softmax(-1))}
    for name, (ours, theirs) in ops.items():
        full = ours(x)
        for row in range(len(x)):
            assert torch.equal(ours(x[row:row + 1]), full[row:row + 1]), (name, row)
        torch.testing.assert_close(full, theirs(x), atol=2e-5, rtol=1e-5, msg=name)
    assert torch.isneginf(tbi.log_softmax(x)[3, 100:2000]).all()
    strided = x[:, ::2]  # a view whose rows are not contiguous
    assert torch.equal(tbi.mean_last_dim(strided), tbi.mean_last_dim(strided.contiguous()))


def sub_batch(case, rows_of: dict[int, tuple[int, int]]):
    """Requests `rows_of` = {request: (first query position, last + 1)} of a prefill case, as
    one step of its own over the same cache: (query, metadata)."""
    meta = case.metadata
    starts = meta.query_start_loc.tolist()
    query_lens, seq_lens, tables, pieces = [], [], [], []
    for request, (lo, hi) in rows_of.items():
        query_lens.append(hi - lo)
        seq_lens.append(hi)
        tables.append(meta.block_tables_cpu[request])
        pieces.append(case.query[starts[request] + lo:starts[request] + hi])
    return torch.cat(pieces), AttentionMetadata.build(query_lens, seq_lens, tables,
                                                      meta.block_size, case.query.device)


# Steps over requests of 45, 9 and 70 tokens: decodes, prefill chunks of other lengths, mixed.
STEPS = [{0: (44, 45)}, {2: (69, 70), 1: (0, 9)}, {2: (30, 47)}, {0: (0, 1), 2: (0, 33)},
         {2: (33, 70), 0: (40, 45)}]


@pytest.mark.parametrize("options", [{}, {"sliding_window": 7}, {"softcap": 5.0, "sinks": True}])
def test_a_tokens_attention_is_the_same_decoded_chunked_or_batched(tbi, options):
    lengths = [45, 9, 70]
    case = make_case(lengths, lengths, num_heads=4, num_kv_heads=2, head_dim=24, block_size=4,
                     **options)
    run = lambda query, meta: tbi.paged_attention(
        query, case.key_cache, case.value_cache, meta, case.scale, **case.options)
    full = run(case.query, case.metadata)
    torch.testing.assert_close(full, naive_attention(case).float(), atol=ATOL[torch.float32],
                               rtol=1e-4)
    starts = case.metadata.query_start_loc.tolist()
    for step in STEPS:
        out = run(*sub_batch(case, step))
        at = 0
        for request, (lo, hi) in step.items():
            expected = full[starts[request] + lo:starts[request] + hi]
            assert torch.equal(out[at:at + hi - lo], expected), (step, request)
            at += hi - lo


def test_the_mode_routes_row_reductions_here_with_torchs_gradients(tbi):
    from rollout_engine.batch_invariant import set_batch_invariant_mode

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 300, generator=gen, requires_grad=True)
    w = torch.randn(300, 300, generator=gen)

    def loss() -> torch.Tensor:
        h = F.linear(x, w) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h.log_softmax(-1)[:, 3].sum() + F.softmax(h, dim=-1, dtype=torch.float32)[:, 7]
                .sum() + torch.mean(h, -1).sum())

    plain = torch.autograd.grad(loss(), x)[0]
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("linear", "mean_last_dim", "log_softmax", "softmax"):
            real = getattr(tbi, name)
            mp.setattr(tbi, name, lambda *a, _real=real, _name=name, **k:
                       calls.append(_name) or _real(*a, **k))
        with set_batch_invariant_mode():
            ours = torch.autograd.grad(loss(), x)[0]
    assert sorted(set(calls)) == ["linear", "log_softmax", "mean_last_dim", "softmax"]
    torch.testing.assert_close(ours, plain, atol=1e-5, rtol=1e-4)


def _hf_causal_mask(lengths: list[int], width: int, side: str) -> torch.Tensor:
    """[B, 1, L, L] bool, as Hugging Face builds it for sdpa: causal and the keys' padding."""
    keys = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        keys[row, slice(0, n) if side == "right" else slice(width - n, width)] = True
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (causal[None] & keys[:, None, :])[:, None]


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_trainers_padded_sdpa_call_equals_the_engines_paged_steps(tbi, side):
    lengths, width = [45, 9, 70], 70
    case = make_case(lengths, lengths, num_heads=4, num_kv_heads=2, head_dim=24, block_size=4)
    paged = tbi.paged_attention(case.query, case.key_cache, case.value_cache, case.metadata,
                                case.scale)
    q = torch.zeros(3, 4, width, 24)
    k, v = torch.randn(3, 2, width, 24), torch.randn(3, 2, width, 24)  # pads: anything
    starts = case.metadata.query_start_loc.tolist()
    for row, n in enumerate(lengths):
        at = slice(0, n) if side == "right" else slice(width - n, width)
        table = case.metadata.block_tables_cpu[row]
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
        q[row, :, at] = case.query[starts[row]:starts[row] + n].transpose(0, 1)
        k[row, :, at] = case.key_cache.flatten(0, 1)[slots].transpose(0, 1)
        v[row, :, at] = case.value_cache.flatten(0, 1)[slots].transpose(0, 1)
    out = tbi.dense_attention(q, k, v, _hf_causal_mask(lengths, width, side), False, case.scale)
    for row, n in enumerate(lengths):
        at = slice(0, n) if side == "right" else slice(width - n, width)
        assert torch.equal(out[row, :, at].transpose(0, 1), paged[starts[row]:starts[row] + n])
    unpadded = tbi.dense_attention(q[2:], k[2:], v[2:], None, True, case.scale)
    assert torch.equal(unpadded[0].transpose(0, 1), paged[starts[2]:])


def test_masks_it_cannot_keep_invariant_are_refused(tbi):
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    window = torch.ones(8, 8, dtype=torch.bool).tril().triu(-3)[None, None]
    with pytest.raises(ValueError, match="causal masks"):
        tbi.dense_attention(q, k, v, window, False, 0.25)
    with pytest.raises(ValueError, match="causal attention"):
        tbi.dense_attention(q, k, v, None, False, 0.25)
    with pytest.raises(TypeError, match="take"):
        tbi.linear(torch.ones(2, 3, dtype=torch.float64), torch.ones(4, 3, dtype=torch.float64))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    from rollout_engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("bi_triton") / "llama", "llama", "tiny"))


@pytest.mark.slow  # about 10 s in the interpreter; the engine test below runs the same path
def test_a_hugging_face_forward_in_the_mode_runs_the_triton_kernels_invariantly(tbi, llama_dir):
    from transformers import AutoModelForCausalLM

    from rollout_engine.batch_invariant import set_batch_invariant_mode
    from tests.integration.test_batch_invariant_trainer import padded

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(10, 512, (n,), generator=gen) for n in (23, 9, 40)]
    calls = []
    real_linear = tbi.linear
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tbi, "linear", lambda *a: calls.append(1) or real_linear(*a))
        with set_batch_invariant_mode(), torch.no_grad():
            alone = [model(s[None]).logits[0].log_softmax(-1) for s in sequences]
            for side in ("right", "left"):
                ids, mask = padded(sequences, side)
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                batch = model(ids, attention_mask=mask, position_ids=positions).logits
                batch = batch.log_softmax(-1)
                for row, own in enumerate(alone):
                    assert torch.equal(batch[row][mask[row].bool()], own), (side, row)
    assert calls  # the Triton linear ran, not the CPU kernel
    with torch.no_grad():
        torch.testing.assert_close(alone[2], model(sequences[2][None]).logits[0].log_softmax(-1),
                                   atol=1e-4, rtol=1e-4)


def test_the_engines_logprobs_are_the_trainers_on_the_triton_kernels(tbi, llama_dir):
    from transformers import AutoModelForCausalLM

    from rollout_engine import LLM, SamplingParams
    from trainer_bridge.invariant_logps import per_token_logps_and_entropies

    prompts = [[5, 9, 14, 5, 9, 14, 5, 9], list(range(20, 57)), [300, 301]]
    params = SamplingParams(n=2, temperature=0.7, max_tokens=6, logprobs=0, seed=3,
                            ignore_eos=True)
    llm = LLM(llama_dir, dtype="float32", batch_invariant=True, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params)
    trainer = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32,
                                                   attn_implementation="sdpa").eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        for sample in output.outputs:  # the trainer bridge's own logprob forward
            ids = torch.tensor([prompt + list(sample.token_ids)])
            with torch.no_grad():
                expected, _, _ = per_token_logps_and_entropies(
                    trainer, ids, torch.ones_like(ids), len(sample.token_ids), params.temperature)
            assert torch.equal(torch.tensor(sample.logprobs), expected[0])
