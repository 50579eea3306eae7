"""What `vllm serve`'s HTTP API costs against gRPC: one GRPO batch (prompts x n samples at
temperature 1, token-id prompts, the sampled tokens' logprobs) through each way in, in one run.

Rows, the paths alternating so that a change in the machine's load hits all alike:
- in process: `LLM.generate`;
- gRPC: `EngineClient.generate` against `rollout-engine serve --http-port 0`;
- HTTP: `POST /v1/completions` to the same server, with the body TRL's `VLLMClient.generate`
  sends (`return_token_ids`, `return_tokens_as_token_ids`, `logprobs=0`);
- vLLM: the same body to `vllm serve` from `.peers/vllm` (`make peers`), if it is installed
  (unseeded: a per-request seed crashes vLLM's CPU build); skipped with a note otherwise.
Goal: HTTP within 10% of gRPC (wall time).

    python -m benchmarks.http_overhead --threads 2          # 8 prompts x n=8, small preset
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import requests
import torch

from benchmarks.common import (
    VllmServer,
    add_grpo_workload_args,
    add_model_args,
    make_prompts,
    vllm_available,
    vllm_missing_note,
)
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.cpu_threads import cpu_seconds
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.server_process import EngineServer

MiB = 1024 * 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=64)
    parser.set_defaults(num_prompts=8, n=8, max_prompt_len=128)
    parser.add_argument("--threads", type=int, help="OpenMP threads of every engine "
                        "(default: each engine's own policy)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 * MiB)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="rollouts per path")
    return parser.parse_args()


def engine_options(args) -> dict:
    return {"max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len":
            args.max_model_len, "max_num_seqs": args.num_prompts * args.n,
            "kv_cache_bytes": args.kv_cache_bytes, "cpu_threads": args.threads}


def completions_body(args, prompts, model: str, seeded: bool = True) -> dict:
    """What TRL's VLLMClient.generate posts (its defaults), EOS ignored for a fixed length."""
    body = {"model": model, "prompt": prompts, "n": args.n, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "max_tokens": args.max_tokens,
            "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "ignore_eos": True}
    return {**body, "seed": args.seed} if seeded else body


def http_run(session: requests.Session, base_url: str, body: dict):
    def run() -> int:
        response = session.post(f"{base_url}/v1/completions", json=body, timeout=3600)
        response.raise_for_status()
        return sum(len(choice["token_ids"]) for choice in response.json()["choices"])
    return run


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (vLLM's engine core runs in a child)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*"):
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        i += 1
    return pids


def cpu_seconds_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(f"/proc/{pid}/stat")
        except OSError:
            pass
    return total


def time_paths(runs: dict, repeats: int) -> dict[str, tuple[float, float, int]]:
    """Best wall time and least CPU time (this process plus the server's tree) per path."""
    best = {name: [float("inf"), float("inf"), 0] for name in runs}
    for run, _ in runs.values():
        run()  # warm-up: first-call costs (compilation, connections) left out
    for _ in range(repeats):
        for name, (run, pids) in runs.items():
            cpu_start, start = cpu_seconds_of(pids()), time.perf_counter()
            num_tokens = run()
            elapsed, cpu = time.perf_counter() - start, cpu_seconds_of(pids()) - cpu_start
            best[name][0] = min(best[name][0], elapsed)
            best[name][1] = min(best[name][1], cpu)
            best[name][2] = num_tokens
    return {name: tuple(values) for name, values in best.items()}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        from transformers import AutoConfig

        from rollout_engine import LLM

        prompts = make_prompts(args, AutoConfig.from_pretrained(model_dir).vocab_size)
        print(f"workload: {len(prompts)} prompts x n={args.n}, prompt lengths "
              f"{args.min_prompt_len}-{args.max_prompt_len}, {args.max_tokens} new tokens, T=1, "
              f"threads {args.threads or 'auto'}", flush=True)
        options = engine_options(args)
        llm = LLM(model_dir, **{k: v for k, v in options.items() if v is not None})
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                                ignore_eos=True, seed=args.seed, logprobs=0)
        me = os.getpid()
        server = EngineServer(model_dir, engine_options=options, extra_args=["--http-port", "0"],
                              log_path=Path(tmp) / "server.log")
        vllm = None
        try:
            client = EngineClient(server.address, timeout=3600)
            session = requests.Session()
            served = [me, server.pid]
            runs = {
                "in process (LLM.generate)": (
                    lambda: _num_tokens(llm.generate(prompts, params)), lambda: [me]),
                "gRPC (EngineClient.generate)": (
                    lambda: _num_tokens(client.generate(prompts, params)), lambda: served),
                "HTTP (POST /v1/completions)": (http_run(session, server.http_url,
                                                         completions_body(args, prompts,
                                                                          model_dir)),
                                                lambda: served),
            }
            if vllm_available():
                vllm = VllmServer(model_dir, max_model_len=args.max_model_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.num_prompts * args.n, threads=args.threads,
                                  log_path=str(Path(tmp) / "vllm.log"))
                runs["vLLM serve (POST /v1/completions, unseeded)"] = (
                    http_run(session, vllm.base_url,
                             completions_body(args, prompts, model_dir, seeded=False)),
                    lambda: [me, *process_tree(vllm.pid)])
            else:
                print(f"vLLM serve row skipped: {vllm_missing_note()}")
            results = time_paths(runs, args.repeats)
            client.close()
        finally:
            server.stop()
            if vllm is not None:
                vllm.stop()
    print_table(results)


def _num_tokens(outputs) -> int:
    return sum(len(c.token_ids) for output in outputs for c in output.outputs)


def print_table(results: dict[str, tuple[float, float, int]]) -> None:
    grpc_wall, grpc_cpu, _ = results["gRPC (EngineClient.generate)"]
    print("\n| path | wall (s) | CPU (s) | tokens | tokens/s | wall vs gRPC | CPU vs gRPC |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (wall, cpu, tokens) in results.items():
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {tokens} | {tokens / wall:.0f} | "
              f"{wall / grpc_wall:.3f}x | {cpu / grpc_cpu:.3f}x |")


if __name__ == "__main__":
    main()
