"""Serving speed measured by vLLM's own client: `vllm bench serve` (random dataset, EOS ignored,
every request sent at once) against our HTTP server and against `vllm serve`, on the same
checkpoint with the same `max_num_seqs`, `max_num_batched_tokens` and KV space, one after the
other in one run. Prints output tok/s, TTFT and ITL per server and our ratio.

Needs `.peers/vllm` (`make peers`): its interpreter runs the client (and `vllm serve`).

    python -m benchmarks.serve_bench --threads 2                        # 64 and 256 prompts
    python -m benchmarks.serve_bench --threads 2 --num-prompts 256 --skip vllm
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from benchmarks.common import (
    VLLM_PYTHON,
    VllmServer,
    add_model_args,
    vllm_available,
    vllm_missing_note,
)
from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge.server_process import EngineServer

_BENCH_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_bench_serve.py"
GiB = 1024**3
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "median_tpot_ms", "duration", "completed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--threads", type=int, help="OpenMP threads of each server")
    parser.add_argument("--skip", nargs="*", default=[], choices=["ours", "vllm"])
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def bench_serve(args, base_url: str, model_dir: str, num_prompts: int, log: Path) -> dict:
    """`vllm bench serve` against `base_url`; its summary (tok/s, TTFT, ITL, ...)."""
    command = [
        str(VLLM_PYTHON), str(_BENCH_SCRIPT), "--backend", "openai", "--base-url", base_url,
        "--endpoint", "/v1/completions", "--model", model_dir, "--tokenizer", model_dir,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts),
        "--ignore-eos", "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm",
    ]
    with open(log, "w") as out:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=out, text=True,
                                timeout=3600, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({result.returncode}); see {log}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    if summary.get("failed"):
        raise RuntimeError(f"{summary['failed']} requests failed against {base_url}; see {log}")
    return summary


def engine_sums(base_url: str) -> dict[str, float]:
    """The server's own `vllm:*` TTFT and end-to-end histograms: {"<name>_sum"/"_count": v}."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            for suffix in ("_sum", "_count"):
                if line.startswith(f"vllm:{name}{suffix}"):
                    key = name + suffix
                    sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def measured_run(args, base_url: str, model_dir: str, num_prompts: int, log: Path) -> dict:
    """`bench_serve`, plus the server's own mean TTFT and end-to-end latency over the run (the
    rest of the client's figure is spent outside the engine: HTTP, tokenizing, streaming)."""
    before = engine_sums(base_url)
    summary = bench_serve(args, base_url, model_dir, num_prompts, log)
    after = engine_sums(base_url)

    def mean_ms(name: str) -> float:
        count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
        return 1000 * (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / max(count, 1)

    summary["engine_mean_ttft_ms"] = mean_ms("time_to_first_token_seconds")
    summary["engine_mean_e2el_ms"] = mean_ms("e2e_request_latency_seconds")
    return summary


def run_server(name: str, args, model_dir: str, tmp: Path) -> dict[int, dict]:
    if name == "ours":
        options = {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "kv_cache_bytes": args.kv_cache_gib * GiB, "cpu_threads": args.threads}
        server = EngineServer(model_dir, engine_options=options, extra_args=["--http-port", "0"],
                              log_path=tmp / "ours.log")
        base_url = server.http_url
    else:
        server = VllmServer(model_dir, max_model_len=args.max_model_len,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, threads=args.threads,
                            kv_cache_gib=args.kv_cache_gib, log_path=str(tmp / "vllm.log"))
        base_url = server.base_url
    try:
        # One short warm-up run (first-call compilation, allocator) before the measured ones.
        bench_serve(args, base_url, model_dir, 8, tmp / f"{name}-warmup.log")
        return {n: measured_run(args, base_url, model_dir, n, tmp / f"{name}-{n}.log")
                for n in args.num_prompts}
    finally:
        server.stop()


def main() -> None:
    args = parse_args()
    if not vllm_available():
        raise SystemExit(vllm_missing_note())
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = args.model or str(build_tiny_model(tmp / "model", args.arch, args.size))
        print(f"workload: random dataset, {args.input_len} in / {args.output_len} out, EOS "
              f"ignored, all requests at once; max_num_seqs {args.max_num_seqs}, threads "
              f"{args.threads or 'auto'}; model {args.model or f'{args.arch}/{args.size}'}",
              flush=True)
        results = {name: run_server(name, args, model_dir, tmp)
                   for name in ("ours", "vllm") if name not in args.skip}
    print_table(results, args.num_prompts)


def print_table(results: dict[str, dict[int, dict]], num_prompts: list[int]) -> None:
    print("\n| prompts | server | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          "TPOT p50 ms | duration s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in num_prompts:
        for name, by_n in results.items():
            r = by_n[n]
            print(f"| {n} | {name} | {r['output_throughput']:.0f} | "
                  f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                  f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | "
                  f"{r['median_tpot_ms']:.1f} | {r['duration']:.1f} |")
        if {"ours", "vllm"} <= results.keys():
            ours, vllm = results["ours"][n], results["vllm"][n]
            print(f"| {n} | ours / vLLM | "
                  f"**{ours['output_throughput'] / vllm['output_throughput']:.2f}x** | "
                  f"{ours['median_ttft_ms'] / vllm['median_ttft_ms']:.2f}x | "
                  f"{ours['median_itl_ms'] / vllm['median_itl_ms']:.2f}x | "
                  f"{ours['median_tpot_ms'] / vllm['median_tpot_ms']:.2f}x | |")
    print("\nWhere a request's time goes (means, ms): the client's figure, the server's own (its "
          "`vllm:*` histograms), and the difference, spent outside the engine's steps.\n")
    print("| prompts | server | TTFT client | TTFT engine | outside | e2e client | e2e engine "
          "| outside |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for n in num_prompts:
        for name, by_n in results.items():
            r = by_n[n]
            print(f"| {n} | {name} | {r['mean_ttft_ms']:.0f} | {r['engine_mean_ttft_ms']:.0f} | "
                  f"{r['mean_ttft_ms'] - r['engine_mean_ttft_ms']:.0f} | {r['mean_e2el_ms']:.0f} | "
                  f"{r['engine_mean_e2el_ms']:.0f} | "
                  f"{r['mean_e2el_ms'] - r['engine_mean_e2el_ms']:.0f} |")


if __name__ == "__main__":
    main()
