"""Time vLLM's CPU attention kernel on one decode step given as JSON; print its ms per call.

Started by `benchmarks.cpu_attention --vllm` with the interpreter of `.peers/vllm` (`make
peers`), as a plain script: it imports vLLM and torch only. The step comes as a JSON file:
{"block_tables": [[ids]], "context": C, "block_size": B, "num_blocks": N, "num_heads": H,
 "num_kv_heads": Hkv, "head_dim": D, "threads": T, "seconds": S, "min_cache_bytes": M,
 "max_layers": L}: every request one query token at `context`, reading the given blocks (the
same tables our kernel reads). The cache is vLLM's layout, [num_blocks, Hkv, 2 * B, D] (a block's
keys, then its values), float32, enough layers (up to L) that one call's KV is out of L3 before
the next call on its layer. The answer, on the last line of stdout: {"ms": median ms per call,
"calls": n, "isa": "...", "version": "..."}.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import torch
    import vllm
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.set_num_threads(job["threads"])
    block_size, heads, kv_heads, dim = (job["block_size"], job["num_heads"], job["num_kv_heads"],
                                        job["head_dim"])
    tables = torch.tensor(job["block_tables"], dtype=torch.int32)
    num_reqs, num_blocks = tables.shape[0], job["num_blocks"]
    seq_lens = torch.full((num_reqs,), job["context"], dtype=torch.int32)
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    layer_bytes = num_blocks * kv_heads * 2 * block_size * dim * 4
    num_layers = max(2, min(job["max_layers"], -(-job["min_cache_bytes"] // layer_bytes)))
    caches = torch.randn(num_layers, num_blocks, kv_heads, 2 * block_size, dim)
    query = torch.randn(num_reqs, heads, dim)
    out = torch.empty_like(query)
    isa = _get_attn_isa(torch.float32, block_size, dim)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        seq_lens=seq_lens, dtype=torch.float32, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False)
    layer = 0

    def call() -> float:
        nonlocal layer
        layer = (layer + 1) % num_layers
        key_cache, value_cache = caches[layer].chunk(2, dim=2)
        start = time.perf_counter()
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=dim**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
            scheduler_metadata=metadata, s_aux=None)
        return time.perf_counter() - start

    call()
    times = []
    deadline = time.perf_counter() + job["seconds"]
    while time.perf_counter() < deadline or len(times) < 10:
        times.append(call())
    print(json.dumps({"ms": statistics.median(times) * 1e3, "calls": len(times), "isa": isa,
                      "version": vllm.__version__}))


if __name__ == "__main__":
    main()
