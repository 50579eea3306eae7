"""Prefill–decode disaggregation against one colocated engine, on a mixed workload.

Ongoing decodes (short prompts, long completions) run while long prompts arrive one after
another. Two set-ups, side by side in one run, on the same model:

- colocated: one `rollout-engine serve` process does everything (chunked prefill interleaves
  the long prompts with the decodes);
- disaggregated: a prefill server (`--kv-role prefill`) and a decode server (`--kv-role
  decode`); each long prompt is prefilled there, its KV moved (transport `--transport`),
  then decoded next to the ongoing decodes, which never see a prefill.

Reported: time to first token of the long prompts, decode tokens/s of the ongoing decodes
and how much the incoming prefills disturb them (inter-token latency while prefills arrive,
against the same decodes alone), and the transfer itself: KV bytes per token and the
transfer bandwidth of each step (gather + publish, fetch, write into blocks) next to a
plain memcpy of the same bytes.

    python -m benchmarks.pd_disagg                       # defaults (a few minutes)
    python -m benchmarks.pd_disagg --num-long 2 --long-len 256 --decode-tokens 64   # quick
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import add_model_args
from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge import EngineClient, KVTransferParams, SamplingParams
from trainer_bridge.server_process import EngineServer

MiB = 1024**2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--num-decodes", type=int, default=8, help="ongoing decodes")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="tokens each decodes (they must outlast the long prompts)")
    parser.add_argument("--num-long", type=int, default=4, help="long prompts arriving")
    parser.add_argument("--long-len", type=int, default=512, help="tokens per long prompt")
    parser.add_argument("--long-interval-s", type=float, default=1.0,
                        help="time between long prompts")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="token budget per step (chunked prefill)")
    parser.add_argument("--transport", default="shm", choices=["shm", "grpc"])
    parser.add_argument("--colocated-threads", type=int, default=2,
                        help="OpenMP threads of the colocated engine")
    parser.add_argument("--disagg-threads", type=int, default=1,
                        help="OpenMP threads of each disaggregated engine (same cores in all)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


@dataclass
class Run:
    """One set-up's measurements."""

    ttft_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    """Disaggregated: the prefill server's part of each TTFT (prefill + save + reply)."""
    decode_token_times: list[list[float]] = field(default_factory=list)
    decode_tokens: int = 0
    decode_wall_s: float = 0.0
    long_window: tuple[float, float] = (0.0, 0.0)

    def inter_token_s(self, inside: bool) -> list[float]:
        """Gaps between consecutive decode tokens, inside or outside the window in which
        long prompts were being prefilled."""
        start, end = self.long_window
        gaps = []
        for times in self.decode_token_times:
            for a, b in itertools.pairwise(times):
                if (start <= b <= end) == inside:
                    gaps.append(b - a)
        return gaps


def stream_times(client: EngineClient, prompt, params) -> list[float]:
    """Arrival time of each token of one prompt's completion."""
    times, seen = [], 0
    for snapshot in client.generate_stream(prompt, params):
        num = len(snapshot.outputs[0].token_ids) if snapshot.outputs else 0
        now = time.monotonic()
        times.extend([now] * (num - seen))
        seen = num
    return times


def run_workload(decode_address: str, prefill_address: str | None, args, prompts) -> Run:
    """Start the decodes, then send the long prompts one by one while they run."""
    short_prompts, long_prompts = prompts
    run = Run()
    decode_params = SamplingParams(temperature=1.0, max_tokens=args.decode_tokens,
                                   ignore_eos=True, seed=1)
    long_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    clients = [EngineClient(decode_address, timeout=600) for _ in range(len(short_prompts))]
    results: dict[int, list[float]] = {}

    def decode(i: int) -> None:
        results[i] = stream_times(clients[i], short_prompts[i], decode_params)

    started = time.monotonic()
    threads = [threading.Thread(target=decode, args=(i,)) for i in range(len(short_prompts))]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # the decodes are under way
    window_start = time.monotonic()
    with EngineClient(decode_address, timeout=600) as decoder:
        prefiller = EngineClient(prefill_address, timeout=600) if prefill_address else None
        for prompt in long_prompts:
            sent = time.monotonic()
            params = long_params
            if prefiller is not None:
                (prefilled,) = prefiller.generate([prompt], SamplingParams(
                    max_tokens=1, detokenize=False,
                    kv_transfer_params=KVTransferParams(do_remote_decode=True)))
                handle = prefilled.outputs[0].kv_transfer_params
                run.prefill_s.append(time.monotonic() - sent)
                params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                        kv_transfer_params=handle)
            for snapshot in decoder.generate_stream(prompt, params):
                if snapshot.outputs and snapshot.outputs[0].token_ids:
                    run.ttft_s.append(time.monotonic() - sent)
                    break
            time.sleep(max(0.0, args.long_interval_s - (time.monotonic() - sent)))
        if prefiller is not None:
            prefiller.close()
    run.long_window = (window_start, time.monotonic())
    for thread in threads:
        thread.join()
    run.decode_token_times = [results[i] for i in range(len(short_prompts))]
    run.decode_wall_s = max(t[-1] for t in run.decode_token_times) - started
    run.decode_tokens = sum(len(t) for t in run.decode_token_times)
    for client in clients:
        client.close()
    return run


def transfer_bandwidth(model_dir: str, long_len: int, seed: int) -> dict[str, float]:
    """GB/s of each step of one KV transfer in process (shm), and of a memcpy of its bytes."""
    from rollout_engine import LLM
    from rollout_engine.core.scheduler_output import KVLoad
    from rollout_engine.worker.kv_transfer.kv_transports import fetch_shm, write_shm

    rng = random.Random(seed)
    prompt = [rng.randrange(3, 500) for _ in range(long_len)]
    llm = LLM(model_dir, kv_role="both", max_num_batched_tokens=2048)
    engine = llm.engine
    transfer = engine.kv_transfer
    llm.generate([prompt], SamplingParams(max_tokens=1))  # blocks now hold the prompt
    probe_blocks, _ = engine.scheduler.kv_cache_manager.get_computed_blocks(
        _probe(prompt))
    block_ids = [b.block_id for b in probe_blocks]
    num_tokens = len(block_ids) * engine.config.cache_config.block_size
    timings: dict[str, list[float]] = {k: [] for k in ("gather", "publish", "fetch", "write",
                                                       "memcpy")}
    for _ in range(5):
        t0 = time.perf_counter()
        kv = transfer.gather(block_ids, num_tokens)
        t1 = time.perf_counter()
        name = write_shm(kv)
        t2 = time.perf_counter()
        data = fetch_shm(KVTransferParams(do_remote_prefill=True, transfer_id="b",
                                          transport="shm", location=name, num_tokens=1), 0.0)
        t3 = time.perf_counter()
        load = KVLoad("b", KVTransferParams(do_remote_prefill=True, transfer_id="b",
                                            transport="shm", num_tokens=num_tokens),
                      tuple(block_ids), 0, num_tokens)
        transfer.write(load, data.view(kv.dtype).view(kv.shape))
        t4 = time.perf_counter()
        copy = torch.empty_like(kv)
        t5 = time.perf_counter()
        copy.copy_(kv)
        t6 = time.perf_counter()
        for key, value in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5)):
            timings[key].append(value)
    num_bytes = kv.numel() * kv.element_size()
    engine.shutdown()
    return {
        "bytes": num_bytes, "tokens": num_tokens, "bytes_per_token": transfer.bytes_per_token,
        **{k: num_bytes / min(v) / 1e9 for k, v in timings.items()},
    }


def _probe(prompt):
    from rollout_engine.core.request import Request

    return Request("probe", prompt, SamplingParams())


def main() -> None:
    args = parse_args()
    model_dir = args.model or str(build_tiny_model(
        Path(tempfile.mkdtemp()) / "model", args.arch, args.size, seed=args.seed))
    rng = random.Random(args.seed)
    short_prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(16, 48))]
                     for _ in range(args.num_decodes)]
    long_prompts = [[rng.randrange(3, 500) for _ in range(args.long_len)]
                    for _ in range(args.num_long)]
    options = {"max_num_batched_tokens": args.max_num_batched_tokens,
               "kv_cache_bytes": 512 * MiB}
    print(f"model {model_dir}: {args.num_decodes} decodes x {args.decode_tokens} tokens, "
          f"{args.num_long} prompts x {args.long_len} tokens every {args.long_interval_s} s",
          flush=True)

    runs: dict[str, Run] = {}
    alone: dict[str, Run] = {}
    with EngineServer(model_dir, engine_options={**options,
                                                 "cpu_threads": args.colocated_threads}) as server:
        alone["colocated"] = run_workload(server.address, None, args, (short_prompts, []))
        runs["colocated"] = run_workload(server.address, None, args,
                                         (short_prompts, long_prompts))
    disagg = {**options, "cpu_threads": args.disagg_threads}
    with EngineServer(model_dir, engine_options={**disagg, "kv_role": "prefill",
                                                 "kv_transport": args.transport}) as prefill, \
            EngineServer(model_dir, engine_options={**disagg, "kv_role": "decode"}) as decode:
        alone["disaggregated"] = run_workload(decode.address, None, args, (short_prompts, []))
        runs["disaggregated"] = run_workload(decode.address, prefill.address, args,
                                             (short_prompts, long_prompts))
    bandwidth = transfer_bandwidth(model_dir, args.long_len, args.seed)
    grpc_gbps = grpc_pull_gbps(model_dir, options, long_prompts[0]) if args.transport == "grpc" \
        else None
    print_tables(runs, alone, bandwidth, grpc_gbps, args)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values) or [float("nan")]
    return values[int(q * (len(values) - 1))]


def print_tables(runs, alone, bandwidth, grpc_gbps, args) -> None:
    print("\n| set-up | TTFT long prompt (s, median) | decode tok/s | decode tok/s alone "
          "| inter-token ms during prefills (mean / p90 / max) | alone (mean / p90) "
          "| p90 disturbance |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        gaps = run.inter_token_s(inside=True) or [float("nan")]
        quiet = alone[name].inter_token_s(inside=False) or [float("nan")]
        tps = run.decode_tokens / run.decode_wall_s
        tps_alone = alone[name].decode_tokens / alone[name].decode_wall_s
        print(f"| {name} | {statistics.median(run.ttft_s):.2f} | {tps:.0f} | {tps_alone:.0f} | "
              f"{1e3 * statistics.mean(gaps):.1f} / {1e3 * percentile(gaps, 0.9):.1f} / "
              f"{1e3 * max(gaps):.1f} | {1e3 * statistics.mean(quiet):.1f} / "
              f"{1e3 * percentile(quiet, 0.9):.1f} | "
              f"{percentile(gaps, 0.9) / percentile(quiet, 0.9):.2f}x |")
    b = bandwidth
    print(f"\nKV per token: {b['bytes_per_token']} bytes; one transfer of {b['tokens']} tokens "
          f"= {b['bytes'] / MiB:.1f} MiB (transport shm, in process, best of 5):\n")
    print("| step | GB/s | vs memcpy |")
    print("|---|---:|---:|")
    for key in ("gather", "publish", "fetch", "write", "memcpy"):
        print(f"| {key} | {b[key]:.2f} | {b[key] / b['memcpy']:.2f}x |")
    end_to_end = 1 / sum(1 / b[k] for k in ("gather", "publish", "fetch", "write"))
    print(f"| shm end to end | {end_to_end:.2f} | {end_to_end / b['memcpy']:.2f}x |")
    for name, run in runs.items():
        if run.prefill_s:
            prefill_s = statistics.median(run.prefill_s)
            print(f"\n{name}: of the TTFT, {prefill_s:.3f} s is the prefill server's (prefill "
                  f"of {args.long_len} tokens, save, reply); the rest "
                  f"({statistics.median(run.ttft_s) - prefill_s:.3f} s) is the transfer and "
                  f"the decode server's first step")
    if grpc_gbps is not None:
        print(f"| gRPC PullKV (bytes only) | {grpc_gbps:.2f} | {grpc_gbps / b['memcpy']:.2f}x |")


def grpc_pull_gbps(model_dir: str, options: dict, prompt: list[int]) -> float:
    """GB/s of PullKV alone: a prefill server saves one prompt's KV, this process pulls it."""
    import grpc

    from protos import rollout_pb2 as pb
    from protos import rollout_pb2_grpc as pb_grpc

    best = float("inf")
    with EngineServer(model_dir, engine_options={**options, "kv_role": "prefill",
                                                 "kv_transport": "grpc"}) as server, \
            EngineClient(server.address, timeout=120) as client:
        channel = grpc.insecure_channel(server.address, options=[
            ("grpc.max_receive_message_length", 64 * MiB)])
        stub = pb_grpc.RolloutEngineStub(channel)
        for _ in range(3):
            (output,) = client.generate([prompt], SamplingParams(
                max_tokens=1, kv_transfer_params=KVTransferParams(do_remote_decode=True)))
            handle = output.outputs[0].kv_transfer_params
            started = time.perf_counter()
            num_bytes = sum(len(m.data) for m in stub.PullKV(
                pb.PullKVRequest(transfer_id=handle.transfer_id)))
            best = min(best, time.perf_counter() - started)
        channel.close()
    return num_bytes / best / 1e9


if __name__ == "__main__":
    main()
