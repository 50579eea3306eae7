"""Scale-out: one engine against two (data parallelism, `EnginePool`), and tensor parallelism
(TP = 2 against TP = 1, step time, for information on a CPU).

Data parallelism: the same GRPO-shaped rollout (prompts x n samples) through one
`rollout-engine serve` process and through an `EnginePool` of two, each engine with one
OpenMP thread, so two engines use the machine's two cores.

Tensor parallelism: the same rollout offline through `LLM(tensor_parallel_size=2)` (two
processes, gloo) and `LLM(tensor_parallel_size=1)`, one thread per rank; on a CPU the
all-reduces go through shared memory, so this measures the mechanism's overhead, not a
GPU's scaling.

    python -m benchmarks.scale_out
    python -m benchmarks.scale_out --num-prompts 8 --max-tokens 32   # quick look
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

from benchmarks.common import add_grpo_workload_args, add_model_args, make_prompts
from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.engine_pool import EnginePool
from trainer_bridge.server_process import EngineServer

MiB = 1024**2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=64)
    parser.add_argument("--skip", nargs="*", default=[], choices=["dp", "tp"])
    return parser.parse_args()


def timed(fn) -> tuple[float, list]:
    started = time.perf_counter()
    outputs = fn()
    return time.perf_counter() - started, outputs


def num_tokens(outputs) -> int:
    return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def data_parallel(model_dir: str, prompts, params) -> dict[str, tuple[float, int]]:
    options = {"cpu_threads": 1, "kv_cache_bytes": 512 * MiB,
               "max_num_seqs": len(prompts) * params.n}
    results = {}
    with EngineServer(model_dir, engine_options=options) as first, \
            EngineServer(model_dir, engine_options=options) as second:
        with EngineClient(first.address, timeout=1800) as client:
            client.generate(prompts[:2], params)  # warm-up
            client.reset_prefix_cache()
            seconds, outputs = timed(lambda: client.generate(prompts, params))
            results["1 engine"] = (seconds, num_tokens(outputs))
        with EnginePool([first.address, second.address], timeout=1800) as pool:
            pool.reset_prefix_cache()
            seconds, outputs = timed(lambda: pool.generate(prompts, params))
            results["2 engines (EnginePool)"] = (seconds, num_tokens(outputs))
    # What a user would do instead: one engine with every core.
    with EngineServer(model_dir, engine_options={**options, "cpu_threads": 2}) as server, \
            EngineClient(server.address, timeout=1800) as client:
        client.generate(prompts[:2], params)
        client.reset_prefix_cache()
        seconds, outputs = timed(lambda: client.generate(prompts, params))
        results["1 engine, 2 threads"] = (seconds, num_tokens(outputs))
    return results


def tensor_parallel(model_dir: str, prompts, params) -> dict[str, tuple[float, int]]:
    from rollout_engine import LLM

    results = {}
    for size in (1, 2):
        llm = LLM(model_dir, tensor_parallel_size=size, cpu_threads=1,
                  kv_cache_bytes=512 * MiB, max_num_seqs=len(prompts) * params.n)
        try:
            llm.generate(prompts[:2], params)  # warm-up
            llm.reset_prefix_cache()
            seconds, outputs = timed(functools.partial(llm.generate, prompts, params))
            results[f"TP = {size}"] = (seconds, num_tokens(outputs))
        finally:
            llm.engine.shutdown()
    return results


def print_table(title: str, results: dict[str, tuple[float, int]]) -> None:
    print(f"\n{title}\n")
    print("| set-up | time (s) | tokens | tokens/s | speed-up |")
    print("|---|---:|---:|---:|---:|")
    base_seconds = next(iter(results.values()))[0]
    for name, (seconds, tokens) in results.items():
        print(f"| {name} | {seconds:.1f} | {tokens} | {tokens / seconds:.0f} | "
              f"{base_seconds / seconds:.2f}x |")


def main() -> None:
    args = parse_args()
    model_dir = args.model or str(build_tiny_model(
        Path(tempfile.mkdtemp()) / "model", args.arch, args.size, seed=args.seed))
    prompts = make_prompts(args, vocab_size=500)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                            ignore_eos=True, seed=1)
    print(f"model {model_dir}: {args.num_prompts} prompts x n={args.n}, "
          f"{args.max_tokens} tokens each", flush=True)
    if "dp" not in args.skip:
        print_table("Data parallelism (one OpenMP thread per engine):",
                    data_parallel(model_dir, prompts, params))
    if "tp" not in args.skip:
        print_table("Tensor parallelism (one thread per rank, gloo; for information):",
                    tensor_parallel(model_dir, prompts, params))


if __name__ == "__main__":
    main()
