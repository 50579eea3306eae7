"""Paged-attention kernel vs PyTorch SDPA on the same data gathered contiguous, on one GPU.

Each row is one batch of a Llama-3-8B-shaped attention layer (32 query heads, 8 KV heads,
head_dim 128, bf16, 16-token blocks at shuffled block ids). `triton` reads K/V through
the block table in one launch; `sdpa` gets the same K/V already gathered into
contiguous tensors (gathering not timed) with the KV heads expanded, so it may use its
fastest backend; `torch ref` is the reference this project runs off CUDA (gather +
SDPA). A mixed row is one launch for us and one SDPA call per uniform group for SDPA.

    python -m benchmarks.kernels            # the table
    python -m benchmarks.kernels --quick    # fewer rows
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import AttentionMetadata
from kernels.paged_attention_ref import paged_attention_ref, store_kv_cache_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DEVICE = "cuda"


@dataclass(frozen=True)
class Workload:
    name: str
    groups: tuple[tuple[int, int, int], ...]
    """(num_reqs, query_len, seq_len) per uniform group; query_len == seq_len is a prompt."""
    quick: bool = False


WORKLOADS = (
    Workload("decode 1 x 8k", ((1, 1, 8192),), quick=True),
    Workload("decode 16 x 4k", ((16, 1, 4096),)),
    Workload("decode 64 x 2k", ((64, 1, 2048),), quick=True),
    Workload("decode 256 x 1k", ((256, 1, 1024),)),
    Workload("spec verify 64 x (4 of 2k)", ((64, 4, 2048),)),
    Workload("prefill 1 x 4k", ((1, 4096, 4096),), quick=True),
    Workload("prefill 8 x 512", ((8, 512, 512),)),
    Workload("mixed: prefill 2k + decode 64 x 2k", ((1, 2048, 2048), (64, 1, 2048)), quick=True),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the rows marked quick")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    return parser.parse_args()


def make_batch(workload: Workload, dtype: torch.dtype):
    """Paged cache at shuffled block ids, its metadata, the query, and SDPA's gathered inputs."""
    query_lens, seq_lens = [], []
    for num_reqs, query_len, seq_len in workload.groups:
        query_lens += [query_len] * num_reqs
        seq_lens += [seq_len] * num_reqs
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(sum(blocks_per_req)).tolist()
    tables, start = [], 0
    for n in blocks_per_req:
        tables.append(perm[start : start + n])
        start += n
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device=DEVICE)
    cache_shape = (len(perm), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype)
    value_cache = torch.randn(cache_shape, device=DEVICE, dtype=dtype)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    return metadata, key_cache, value_cache, query, gather_for_sdpa(workload, metadata, key_cache,
                                                                     value_cache, query)


def gather_for_sdpa(workload, metadata, key_cache, value_cache, query) -> list[tuple]:
    """Per uniform group: q [B, H, q, D], k and v [B, H, L, D] contiguous, is_prompt."""
    inputs, req, token = [], 0, 0
    for num_reqs, query_len, seq_len in workload.groups:
        tables = metadata.block_tables[req : req + num_reqs, : -(-seq_len // BLOCK_SIZE)].long()
        q = query[token : token + num_reqs * query_len]
        q = q.view(num_reqs, query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        inputs.append((q, gather(key_cache, tables, seq_len), gather(value_cache, tables, seq_len),
                       query_len == seq_len and query_len > 1))
        req, token = req + num_reqs, token + num_reqs * query_len
    return inputs


def gather(cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, H, seq_len, D]: each request's K or V in position order, KV heads expanded."""
    flat = cache[tables].flatten(1, 2)[:, :seq_len]  # [B, L, Hkv, D]
    group_size = NUM_HEADS // NUM_KV_HEADS
    return flat.transpose(1, 2).repeat_interleave(group_size, dim=1).contiguous()


def sdpa(inputs: list[tuple], scale: float) -> list[torch.Tensor]:
    outs = []
    for q, k, v, is_prompt in inputs:
        if is_prompt or q.shape[2] == 1:
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=is_prompt, scale=scale))
        else:  # query at the last positions: causal aligned to the bottom right
            q_len, s_len = q.shape[2], k.shape[2]
            mask = (torch.arange(s_len, device=q.device)[None, :]
                    <= torch.arange(s_len - q_len, s_len, device=q.device)[:, None])
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))
    return outs


def max_error(ours: torch.Tensor, theirs: list[torch.Tensor]) -> float:
    flat = torch.cat([o.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM) for o in theirs])
    return (ours.float() - flat.float()).abs().max().item()


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def run_attention(workloads, dtype: torch.dtype) -> list[tuple]:
    rows = []
    for workload in workloads:
        torch.manual_seed(0)
        rows.append(measure(workload, dtype))
        torch.cuda.empty_cache()
    return rows


def measure(workload: Workload, dtype: torch.dtype) -> tuple:
    from kernels.triton_paged_attention import choose_config, paged_attention_triton

    scale = HEAD_DIM**-0.5
    metadata, key_cache, value_cache, query, inputs = make_batch(workload, dtype)
    args = (query, key_cache, value_cache, metadata, scale)
    error = max_error(paged_attention_triton(*args), sdpa(inputs, scale))
    num_splits = choose_config(query, key_cache, metadata).num_splits
    triton_ms = bench_ms(lambda: paged_attention_triton(*args))
    sdpa_ms = bench_ms(lambda: sdpa(inputs, scale))
    ref_ms = bench_ms(lambda: paged_attention_ref(*args))
    return (workload.name, query.shape[0], metadata.max_seq_len, num_splits, triton_ms, sdpa_ms,
            ref_ms, error)


def run_store(dtype: torch.dtype) -> tuple[float, float]:
    from kernels.triton_kv_store import store_kv_cache_triton

    num_tokens, num_blocks = 8192, 4096
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    other = cache.clone()
    triton_ms = bench_ms(lambda: store_kv_cache_triton(key, key, cache, other, slots))
    ref_ms = bench_ms(lambda: store_kv_cache_ref(key, key, cache, other, slots))
    return triton_ms, ref_ms


def print_tables(rows: list[tuple], store: tuple[float, float], dtype: torch.dtype) -> None:
    print(f"\n{torch.cuda.get_device_name()}, {dtype}, H={NUM_HEADS} Hkv={NUM_KV_HEADS} "
          f"D={HEAD_DIM} block={BLOCK_SIZE}, median ms")
    print("\n| batch | tokens | max KV | splits | triton ms | sdpa ms | sdpa / triton "
          "| torch ref ms | ref / triton | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, tokens, max_kv, splits, triton_ms, sdpa_ms, ref_ms, error in rows:
        print(f"| {name} | {tokens} | {max_kv} | {splits} | {triton_ms:.3f} | {sdpa_ms:.3f} | "
              f"{sdpa_ms / triton_ms:.2f}x | {ref_ms:.3f} | {ref_ms / triton_ms:.2f}x | "
              f"{error:.1e} |")
    triton_ms, ref_ms = store
    print(f"\nKV store, 8192 tokens: triton {triton_ms:.3f} ms, torch index_copy "
          f"{ref_ms:.3f} ms ({ref_ms / triton_ms:.2f}x)")


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.kernels needs an NVIDIA GPU (torch.cuda.is_available() is False); "
              "nothing measured.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks.kernels needs triton: pip install -e '.[gpu]'")
        return 1
    dtype = getattr(torch, args.dtype)
    workloads = [w for w in WORKLOADS if w.quick or not args.quick]
    rows = run_attention(workloads, dtype)
    print_tables(rows, run_store(dtype), dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
