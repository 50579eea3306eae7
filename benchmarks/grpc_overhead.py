"""What the gRPC wire costs: GRPO-shaped rollouts and weight updates, served vs in process.

Two measurements, side by side in one run, on the same model:

1. Rollout: a batch of prompts x n samples at temperature 1 (as in
   `benchmarks.rollout_throughput`), through `EngineClient.generate` against a
   `rollout-engine serve` process, and through the in-process `LLM.generate`.
   Goal: gRPC at most 10% slower.
2. Weight update bandwidth of each transport (`stream`, `shm`, and `cuda_ipc` when CUDA is
   there), next to a plain memcpy of the same tensors into preallocated ones, and next to
   a bare gRPC stream of the same number of bytes into a sink service defined here.
   Goals: shm at least 50% of memcpy; stream at least 80% of the bare gRPC stream.

    python -m benchmarks.grpc_overhead                                     # defaults
    python -m benchmarks.grpc_overhead --num-prompts 8 --n 4 --max-tokens 32   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO_ROOT, add_grpo_workload_args, add_model_args, make_prompts
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.cpu_threads import cpu_seconds
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.transports import DEFAULT_STREAM_CHUNK_BYTES

MiB = 1024 * 1024
SINK_METHOD = "/bench.Sink/Push"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_grpo_workload_args(parser, max_tokens=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1024 * MiB)
    parser.add_argument("--num-rollout-repeats", type=int, default=2, help="rollouts per path")
    parser.add_argument("--num-repeats", type=int, default=10, help="weight updates per path")
    return parser.parse_args()


def engine_options(args) -> dict:
    return {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.num_prompts * args.n,
        "kv_cache_bytes": args.kv_cache_bytes,
    }


def sampling_kwargs(args) -> dict:
    return {"n": args.n, "temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True,
            "seed": args.seed}


# ------------------------------------------------------------------------------- rollouts


def cpu_seconds_of(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (all their threads)."""
    return sum(cpu_seconds(f"/proc/{pid}/stat") for pid in pids)


def time_rollouts(llm, client: EngineClient, server_pid: int, prompts, args):
    """Best wall time and least CPU time of each path over `num_rollout_repeats` runs, the
    paths alternating so that a change in the machine's load hits both alike. CPU time (of
    this process, plus the server's for gRPC) is what the machine's other tenants cannot
    inflate much."""
    local_params = remote_params = SamplingParams(**sampling_kwargs(args))  # one shared type
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
    client.generate(prompts[:1], SamplingParams(max_tokens=2))
    me = os.getpid()
    # In process, the engine steps on the thread that built it, as the server's engine does
    # (an engine stepped from another thread gets a second OpenMP pool: see LLMEngine).
    runs = {
        "in process (LLM.generate)": (lambda: llm.generate(prompts, local_params), [me]),
        "gRPC (EngineClient.generate)": (
            lambda: client.generate(prompts, remote_params), [me, server_pid]),
    }
    best = {name: [float("inf"), float("inf"), 0] for name in runs}
    for _ in range(args.num_rollout_repeats):
        for name, (run, pids) in runs.items():
            cpu_start, start = cpu_seconds_of(pids), time.perf_counter()
            outputs = run()
            elapsed, cpu = time.perf_counter() - start, cpu_seconds_of(pids) - cpu_start
            best[name][0] = min(best[name][0], elapsed)
            best[name][1] = min(best[name][1], cpu)
            best[name][2] = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    return {name: tuple(values) for name, values in best.items()}


class Server:
    """A `rollout-engine serve` subprocess on 127.0.0.1 with a free port."""

    def __init__(self, model_dir: str, args, log_dir: str) -> None:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_options(args).items()]
        self.log_path = Path(log_dir) / "server.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the server
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rollout_engine.cli", "serve", "--model", model_dir,
             "--port", "0", *flags],
            cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        self.address = self._wait_ready()

    def _wait_ready(self, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            match = re.search(r"serving .* on (\S+:\d+)", self.log_path.read_text())
            if match:
                return match.group(1)
            time.sleep(0.1)
        raise RuntimeError(f"server did not start:\n{self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self._log.close()


# -------------------------------------------------------------------------- weight update


def memcpy_run(weights: dict[str, torch.Tensor]):
    """Copy every tensor into a preallocated one, as an in-process update does."""
    targets = {name: torch.empty_like(t) for name, t in weights.items()}

    def copy_all() -> None:
        for name, tensor in weights.items():
            targets[name].copy_(tensor)

    return copy_all


def _sink_main(port_queue) -> None:
    """A gRPC aio server in its own process whose one method swallows a byte stream."""
    import grpc

    async def push(request_iterator, context) -> bytes:
        num_bytes = 0
        async for chunk in request_iterator:
            num_bytes += len(chunk)
        return num_bytes.to_bytes(8, "little")

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * MiB)])
        handler = grpc.method_handlers_generic_handler(
            "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)}
        )
        server.add_generic_rpc_handlers((handler,))
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


class BareStream:
    """The same bytes, in chunks of the stream transport's size, into a do-nothing service
    running in its own process, like the engine server."""

    def __init__(self, total_bytes: int) -> None:
        import grpc

        ctx = multiprocessing.get_context("spawn")
        port_queue = ctx.Queue()
        self._sink = ctx.Process(target=_sink_main, args=(port_queue,), daemon=True)
        self._sink.start()
        port = port_queue.get(timeout=60)
        self._channel = grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MiB)])
        self._push = self._channel.stream_unary(SINK_METHOD)
        self.total_bytes = total_bytes
        self._chunk = os.urandom(DEFAULT_STREAM_CHUNK_BYTES)

    def _chunks(self):
        remaining = self.total_bytes
        while remaining > 0:
            yield self._chunk if remaining >= len(self._chunk) else self._chunk[:remaining]
            remaining -= len(self._chunk)

    def __call__(self) -> None:
        num_bytes = int.from_bytes(self._push(self._chunks(), timeout=600), "little")
        assert num_bytes == self.total_bytes

    def close(self) -> None:
        self._channel.close()
        self._sink.terminate()
        self._sink.join()


def weight_update_seconds(client: EngineClient, weights, total_bytes: int, num_repeats: int):
    """Best time of each path; one warm-up each, then the paths alternate `num_repeats` times."""
    bare = BareStream(total_bytes)
    runs = {
        "memcpy (tensor.copy_)": memcpy_run(weights),
        "bare gRPC stream (sink)": bare,
        "update_weights stream": lambda: client.update_weights(weights, transport="stream"),
        "update_weights shm": lambda: client.update_weights(weights, transport="shm"),
    }
    if torch.cuda.is_available() and client.info().device.startswith("cuda"):
        cuda_weights = {k: v.cuda() for k, v in weights.items()}
        runs["update_weights cuda_ipc"] = lambda: client.update_weights(
            cuda_weights, transport="cuda_ipc")
    try:
        for run in runs.values():
            run()
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(num_repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        bare.close()
    return best


# ---------------------------------------------------------------------------------- report


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(Path(tmp) / "model", args.arch, args.size))
        from safetensors.torch import load_file
        from transformers import AutoConfig

        prompts = make_prompts(args, AutoConfig.from_pretrained(model_dir).vocab_size)
        print(f"workload: {len(prompts)} prompts x n={args.n}, prompt lengths "
              f"{args.min_prompt_len}-{args.max_prompt_len}, {args.max_tokens} new tokens, "
              f"T=1, {torch.get_num_threads()} threads", flush=True)
        from rollout_engine import LLM

        llm = LLM(model_dir, **engine_options(args))
        server = Server(model_dir, args, tmp)
        try:
            with EngineClient(server.address) as client:
                client.wait_until_ready(60)
                rollout = time_rollouts(llm, client, server.process.pid, prompts, args)
                del llm
                weights = {k: v.contiguous() for k, v in
                           load_file(str(Path(model_dir) / "model.safetensors")).items()}
                total_bytes = sum(t.nbytes for t in weights.values())
                seconds = weight_update_seconds(client, weights, total_bytes, args.num_repeats)
        finally:
            server.stop()
    print_rollout_table(rollout)
    print_weight_table(seconds, total_bytes)


def print_rollout_table(results: dict[str, tuple[float, float, int]]) -> None:
    base_wall, base_cpu, _ = results["in process (LLM.generate)"]
    print("\n| rollout path | wall (s) | CPU (s) | tokens | tokens/s | wall vs in process "
          "| CPU vs in process |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (wall, cpu, tokens) in results.items():
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {tokens} | {tokens / wall:.0f} | "
              f"{wall / base_wall:.3f}x | {cpu / base_cpu:.3f}x |")


def print_weight_table(seconds: dict[str, float], total_bytes: int) -> None:
    memcpy = seconds["memcpy (tensor.copy_)"]
    bare = seconds["bare gRPC stream (sink)"]
    print(f"\n| weight path ({total_bytes / MiB:.0f} MiB) | time (ms) | GiB/s | "
          "vs memcpy | vs bare gRPC stream |")
    print("|---|---:|---:|---:|---:|")
    for name, elapsed in seconds.items():
        rate = total_bytes / elapsed / 1024**3
        print(f"| {name} | {elapsed * 1e3:.1f} | {rate:.2f} | {memcpy / elapsed:.0%} | "
              f"{bare / elapsed:.0%} |")


if __name__ == "__main__":
    main()
