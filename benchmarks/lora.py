"""LoRA policies: adapter-only weight sync against a merged full sync, and decode speed with
adapters in the batch against the base model.

    python -m benchmarks.lora --threads 2                    # 0.5B-shaped model, everything
    python -m benchmarks.lora --size small --skip sync       # decode only, a quick look
    python -m benchmarks.lora --size small --moe --skip sync # a Qwen3-MoE, experts adapted too

**Sync** (a real server, `--transports`): the time to push an all-linear adapter of rank
`--sync-rank` from memory (`EngineClient.load_lora_adapter`, in place, no disk) and its
bytes, against pushing the whole model (`update_weights`: what a merged LoRA sync sends
every step). Best of `--sync-repeats`.

**Decode** (in process): a GRPO batch (prompts x n samples, temperature 1, EOS ignored) under
1 and 8 adapters (prompt i under adapter i % count) at each rank of `--ranks`, against the
same batch on the base model, one engine for all rows (rounds alternate; each row keeps its
best). vLLM's CPU build (`make peers`) runs the same batches with the same adapters when it is
installed (`--skip vllm` leaves it out).

Adapters are random (PEFT's layout and names, written directly: no PEFT model of this size is
built), A ~ N(0, 1/in), B ~ N(0, 0.02^2), so that they change the tokens a little. With
`--moe` the model is `model_impl`'s Qwen3-MoE (`--num-experts`, 2 per token) and the adapters
take its attention linears and every expert's gate|up and down (PEFT's `target_parameters`).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchmarks.common import (
    add_grpo_workload_args,
    add_model_args,
    make_prompts,
    run_vllm,
    vllm_available,
    vllm_missing_note,
)
from rollout_engine import LLM, LoRARequest, SamplingParams
from rollout_engine.tiny_model import build_tiny_model

LINEARS = {  # module -> (in features, out features) as functions of the config
    "self_attn.q_proj": lambda c, d: (c.hidden_size, c.num_attention_heads * d),
    "self_attn.k_proj": lambda c, d: (c.hidden_size, c.num_key_value_heads * d),
    "self_attn.v_proj": lambda c, d: (c.hidden_size, c.num_key_value_heads * d),
    "self_attn.o_proj": lambda c, d: (c.num_attention_heads * d, c.hidden_size),
    "mlp.gate_proj": lambda c, d: (c.hidden_size, c.intermediate_size),
    "mlp.up_proj": lambda c, d: (c.hidden_size, c.intermediate_size),
    "mlp.down_proj": lambda c, d: (c.intermediate_size, c.hidden_size),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.set_defaults(size="0.5b")
    add_grpo_workload_args(parser, max_tokens=32)
    parser.set_defaults(num_prompts=16, min_prompt_len=32, max_prompt_len=96)
    parser.add_argument("--threads", type=int, help="OpenMP threads (default: the engine's)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--adapter-counts", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sync-rank", type=int, default=16)
    parser.add_argument("--sync-repeats", type=int, default=5)
    parser.add_argument("--transports", nargs="+", default=["shm", "stream"],
                        choices=["shm", "stream"])
    parser.add_argument("--skip", nargs="*", default=[], choices=["sync", "decode", "vllm"])
    parser.add_argument("--vllm-timeout-s", type=float, default=600.0,
                        help="give a vLLM job up after this long (its LoRA decode on the CPU "
                        "can take far longer than ours)")
    parser.add_argument("--greedy-check", action="store_true",
                        help="then greedy tokens under the adapters (rank 16 or the first of "
                        "--ranks, one per prompt), ours against vLLM's")
    parser.add_argument("--moe", action="store_true",
                        help="a Qwen3-MoE of --size, adapters on attention and experts")
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args()


# ------------------------------------------------------------------------------ adapters
def write_adapter(model_dir: str, out_dir: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter of every linear (and every expert of a MoE), as PEFT saves one."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(seed)

    def pair(name: str, in_features: int, out_features: int, experts: int = 1) -> None:
        tensors[f"{name}.lora_A.weight"] = (
            torch.randn(experts * rank, in_features, generator=generator) / in_features**0.5)
        tensors[f"{name}.lora_B.weight"] = (
            torch.randn(out_features, rank * experts, generator=generator) * 0.02)

    moe = getattr(config, "num_experts", None)
    linears = {m: f for m, f in LINEARS.items() if not (moe and m.startswith("mlp."))}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{layer}"
        for module, shape_of in linears.items():
            pair(f"{prefix}.{module}", *shape_of(config, head_dim))
        if moe:  # PEFT's nesting (what vLLM reads): gate|up inside, down outside
            width = config.moe_intermediate_size
            pair(f"{prefix}.mlp.experts.base_layer", config.hidden_size, 2 * width, moe)
            pair(f"{prefix}.mlp.experts", width, config.hidden_size, moe)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    targets = sorted({m.split(".")[-1] for m in linears})
    parameters = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"] if moe else []
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "target_parameters": parameters,
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": model_dir, "fan_in_fan_out": False, "use_dora": False,
        "use_rslora": False, "modules_to_save": None, "init_lora_weights": True,
    }))
    return out_dir


def num_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------- sync
def bench_sync(model_dir: str, adapter_dir: Path, args) -> list[dict]:
    from trainer_bridge import EngineClient
    from trainer_bridge.server_process import EngineServer

    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    peft_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    options = {"enable_lora": True, "max_lora_rank": args.sync_rank, "kv_cache_bytes": "64MiB",
               "max_model_len": 512}
    if args.threads:
        options["cpu_threads"] = args.threads
    rows = []
    with EngineServer(model_dir, engine_options=options) as server, \
            EngineClient(server.address, timeout=600) as client:
        client.wait_until_ready(120)
        for transport in args.transports:
            adapter_s = best_of(args.sync_repeats, functools.partial(
                client.load_lora_adapter, "policy", adapter, peft_config, load_inplace=True,
                transport=transport))
            full_s = best_of(max(1, args.sync_repeats // 2), functools.partial(
                client.update_weights, weights, transport=transport))
            rows.append({"transport": transport, "adapter_s": adapter_s,
                         "adapter_bytes": num_bytes(adapter.values()), "full_s": full_s,
                         "full_bytes": num_bytes(weights.values())})
    return rows


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# -------------------------------------------------------------------------------- decode
def bench_decode(model_dir: str, adapters: dict[int, list[Path]], prompts, args) -> dict:
    """tok/s per row ("base", or (rank, count)), best of the rounds."""
    max_rank = max(adapters)
    max_loras = max(args.adapter_counts)
    llm = LLM(model_dir, enable_lora=True, max_loras=max_loras, max_lora_rank=max_rank,
              max_cpu_loras=max_loras * len(adapters), max_num_seqs=len(prompts) * args.n,
              max_num_batched_tokens=2048, kv_cache_bytes=2 * 1024**3, cpu_threads=args.threads)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=args.seed)
    requests = {rank: [LoRARequest(f"r{rank}-{i}", 100 * rank + i + 1, str(path))
                       for i, path in enumerate(paths)] for rank, paths in adapters.items()}
    rows = [("base", None)] + [((rank, count), [requests[rank][i % count]
                                                for i in range(len(prompts))])
                               for rank in sorted(adapters) for count in args.adapter_counts]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    best: dict = {}
    for _ in range(args.repeats):
        for key, loras in rows:
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=loras)
            elapsed = time.perf_counter() - start
            num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            best[key] = max(best.get(key, 0.0), num_tokens / elapsed)
            print(f"  {key}: {num_tokens / elapsed:,.0f} tok/s", flush=True)
    llm.engine.shutdown()
    return best


def bench_vllm(model_dir: str, adapters: dict[int, list[Path]], prompts, args) -> dict:
    best: dict = {}
    jobs = [("base", None)] + [((rank, count), [str(p) for p in adapters[rank][:count]])
                               for rank in sorted(adapters) for count in args.adapter_counts]
    for key, paths in jobs:
        try:
            result = run_vllm(model_dir, prompts, n=args.n, max_tokens=args.max_tokens,
                              max_model_len=args.max_prompt_len + args.max_tokens + 16,
                              max_num_batched_tokens=2048, threads=args.threads,
                              repeats=args.repeats, lora_paths=paths,
                              max_lora_rank=max(adapters), enforce_eager=True,
                              timeout_s=args.vllm_timeout_s, moe_lora_3d=args.moe)
        except subprocess.TimeoutExpired:
            print(f"  vLLM {key}: not done after {args.vllm_timeout_s:.0f} s, given up")
            continue
        except RuntimeError as exc:
            print(f"  vLLM {key}: failed: {str(exc).splitlines()[-1][:200]}")
            continue
        best[key] = result["num_tokens"] / min(result["elapsed_s"])
        print(f"  vLLM {key}: {best[key]:,.0f} tok/s", flush=True)
    return best


def greedy_check(model_dir: str, paths: list[Path], prompts, args) -> tuple[int, int]:
    """(identical sequences, prompts): greedy tokens of every prompt under adapter i % count,
    ours against vLLM's."""
    rank = 16 if 16 in args.ranks else args.ranks[0]
    llm = LLM(model_dir, enable_lora=True, max_loras=len(paths), max_lora_rank=rank,
              kv_cache_bytes=1024**3, cpu_threads=args.threads)
    loras = [LoRARequest(f"g{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ours = llm.generate(prompts, params,
                        lora_request=[loras[i % len(loras)] for i in range(len(prompts))])
    llm.engine.shutdown()
    theirs = run_vllm(model_dir, prompts, n=1, max_tokens=args.max_tokens,
                      max_model_len=args.max_prompt_len + args.max_tokens + 16,
                      max_num_batched_tokens=2048, threads=args.threads, greedy=True,
                      lora_paths=[str(p) for p in paths], max_lora_rank=rank,
                      enforce_eager=True, moe_lora_3d=args.moe)["token_ids"]
    same = sum(list(o.outputs[0].token_ids) == t for o, t in zip(ours, theirs))
    return same, len(prompts)


# ---------------------------------------------------------------------------------- main
def print_decode_table(ours: dict, vllm: dict) -> None:
    print("\n| adapters | rank | ours tok/s | vs base | vLLM tok/s | vLLM vs its base |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, tok_s in ours.items():
        count, rank = ("none", "-") if key == "base" else (key[1], key[0])
        ratio = tok_s / ours["base"]
        theirs = vllm.get(key)
        their_ratio = "" if theirs is None or "base" not in vllm else f"{theirs / vllm['base']:.2f}x"
        print(f"| {count} | {rank} | {tok_s:,.0f} | {ratio:.2f}x | "
              f"{'' if theirs is None else f'{theirs:,.0f}'} | {their_ratio} |")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model:
            model_dir = args.model
        elif args.moe:
            from benchmarks.model_impl import moe_model_dir

            model_dir = str(moe_model_dir(root, args))
        else:
            model_dir = str(build_tiny_model(root / "model", args.arch, args.size))
        ranks = sorted(set(args.ranks) | ({args.sync_rank} if "sync" not in args.skip else set()))
        adapters = {rank: [write_adapter(model_dir, root / f"r{rank}-{i}", rank, seed=i)
                           for i in range(max(args.adapter_counts))] for rank in ranks}
        if "sync" not in args.skip:
            print("sync: adapter push vs full push")
            results["sync"] = bench_sync(model_dir, adapters[args.sync_rank][0], args)
            for row in results["sync"]:
                print(f"  {row['transport']}: adapter (r={args.sync_rank}) "
                      f"{row['adapter_bytes'] / 2**20:.1f} MiB in {row['adapter_s'] * 1e3:.1f} ms; "
                      f"full model {row['full_bytes'] / 2**20:.0f} MiB in "
                      f"{row['full_s'] * 1e3:.0f} ms ({row['full_s'] / row['adapter_s']:.0f}x, "
                      f"{row['full_bytes'] / row['adapter_bytes']:.0f}x the bytes)")
        if "decode" not in args.skip:
            from transformers import AutoConfig

            vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
            prompts = make_prompts(args, vocab_size)
            decode_adapters = {r: adapters[r] for r in args.ranks}
            print(f"decode: {len(prompts)} prompts x {args.n}, {args.max_tokens} new tokens")
            ours = bench_decode(model_dir, decode_adapters, prompts, args)
            vllm = {}
            if "vllm" not in args.skip:
                if vllm_available():
                    vllm = bench_vllm(model_dir, decode_adapters, prompts, args)
                else:
                    print(vllm_missing_note())
            print_decode_table(ours, vllm)
            results["decode"] = {str(k): v for k, v in ours.items()}
            results["vllm_decode"] = {str(k): v for k, v in vllm.items()}
        if args.greedy_check and vllm_available():
            from transformers import AutoConfig

            prompts = make_prompts(args, AutoConfig.from_pretrained(model_dir).vocab_size)
            rank = 16 if 16 in args.ranks else args.ranks[0]
            same, total = greedy_check(model_dir, adapters[rank], prompts, args)
            print(f"greedy under {len(adapters[rank])} adapters (r={rank}): {same} of {total} "
                  "sequences identical to vLLM's")
            results["greedy_identical"] = [same, total]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
