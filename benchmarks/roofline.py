"""How close the engine's step runs to this machine's limits: the measured peaks (a large GEMM in
float32 and bfloat16, a STREAM-like triad), then, for each rollout workload, the FLOP/s and
bytes/s the steps achieved as a share of those peaks, and where the step's time went.

FLOPs and bytes are counted from what each step ran (its tokens, their contexts, its logits
rows), not estimated from the workload:
- linears: 2 x (the model's linear parameters) per token; logits: 2 x vocab x hidden per row;
- attention: 4 x heads x head_dim per (query token, context token) pair, per layer;
- bytes: every weight once per step, plus each sequence's KV (what a kernel must read when no
  prompt is shared; with n samples per prompt our CPU attention reads a shared prefix once, so
  it can beat this count).
A bfloat16 run is measured against the peak of the dtype its linears compute in: bfloat16's,
or float32's on a CPU without bfloat16 arithmetic (its packed copies are float32 there), and
its weight bytes counted likewise.
The time split wraps the model's linears, its attention, the logits and the sampler with
timers; "other" is the rest of the forward (norms, rotary, embedding, elementwise), "host" the
step's wall time outside the forward and sampling (scheduling, inputs, outputs).

    python -m benchmarks.roofline --threads 2                      # all workloads, float32
    python -m benchmarks.roofline --threads 2 --workloads grpo --dtype bfloat16
    python -m benchmarks.roofline --threads 2 --workloads grpo --repeats 3

`--repeats R` runs each workload R times, each on a fresh engine (no prefix cache carried over),
and reports its fastest run, as the peaks report their fastest of five calls: on a machine whose
memory is shared with neighbours, a single run can land in a slow minute. The table gives every
run's tok/s too.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from benchmarks.common import add_model_args, kv_bytes_per_token, kv_cache_bytes_for, make_prompts
from rollout_engine import LLM, SamplingParams
from rollout_engine.tiny_model import build_tiny_model
from rollout_engine.worker.models import decoder as decoder_module
from rollout_engine.worker.models.packed_linear import PackedLinear, gemm_dtype

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile",
                "avx_vnni")
WORKLOADS = {
    # name: (prompts, n, prompt lengths, new tokens); the rollout benchmarks' workloads.
    "grpo": (32, 8, (64, 256), 128),
    "long256": (8, 8, (64, 256), 256),
    "long1024": (8, 8, (64, 256), 1024),
    "long4096": (8, 8, (64, 256), 4096),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--threads", type=int, help="OpenMP threads (default: all cores)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--gemm-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per workload, each on a fresh engine; the fastest is reported")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


# ------------------------------------------------------------------------------- the machine
def cpu_description() -> str:
    """The CPU's model name and the vector features the kernels can use."""
    name, flags = platform.processor() or "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name in ("unknown CPU", "x86_64", ""):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    features = [flag for flag in VECTOR_FLAGS if flag in flags] or ["none of " + ", ".join(
        VECTOR_FLAGS)]
    capability = torch.backends.cpu.get_cpu_capability()
    return f"{name}; {' '.join(features)}; torch dispatches {capability}"


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_gemm_flops(dtype: torch.dtype, max_size: int) -> tuple[float, int]:
    """(FLOP/s, size) of the best square matmul: sizes double from 256 up to `max_size` while
    one call stays under a second (a dtype the CPU only emulates stays small)."""
    size, best = 256, (0.0, 256)
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        seconds = best_seconds(lambda a=a, b=b: torch.mm(a, b), repeats=5)
        best = max(best, (2 * size**3 / seconds, size))
        if size * 2 > max_size or seconds * 8 > 1.0:
            return best
        size *= 2


def peak_bandwidth(num_bytes: int = 512 * 1024**2) -> float:
    """Bytes/s of a triad c = a + s * b over float32 arrays far larger than the caches."""
    n = num_bytes // 4
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    return 3 * num_bytes / best_seconds(lambda: torch.add(a, b, alpha=3.0, out=c), repeats=5)


def peak_read_bandwidth(num_bytes: int = 512 * 1024**2) -> float:
    """Bytes/s of a plain sum over a float32 array far larger than the caches: the roof of a
    kernel that only reads, as decode attention does."""
    a = torch.rand(num_bytes // 4)
    return num_bytes / best_seconds(a.sum, repeats=5)


# ----------------------------------------------------------------------- what the steps ran
@dataclass
class ModelShape:
    linear_params: int
    """Parameters of every linear but the LM head (embedding lookups do no FLOPs)."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention_width: int
    """Query heads x head dim (this rank's)."""
    weight_bytes: int
    """Bytes of every weight a step reads: the linears and the LM head."""
    kv_bytes_per_token: int
    """All layers."""

    @classmethod
    def of(cls, llm: LLM, model_dir: str, dtype: torch.dtype) -> ModelShape:
        config = llm.engine.hf_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = torch.finfo(gemm_dtype(dtype)).bits // 8  # float32 copies of bf16 weights
        linear_params = sum(
            p.numel() for name, p in llm.engine.worker.model_runner.model.named_parameters()
            if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name)
        vocab, hidden = config.vocab_size, config.hidden_size
        return cls(linear_params, vocab, hidden, config.num_hidden_layers,
                   config.num_attention_heads * head_dim, (linear_params + vocab * hidden) * element,
                   kv_bytes_per_token(model_dir, dtype))


@dataclass
class StepCounts:
    """What the timed steps computed and read, summed."""

    tokens: int = 0
    logits_rows: int = 0
    attention_pairs: int = 0
    """(query token, context token) pairs, per layer."""
    kv_tokens_read: int = 0
    num_steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add_step(self, metadata, num_logits_rows: int) -> None:
        self.num_steps += 1
        self.logits_rows += num_logits_rows
        for q, s in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu):
            self.tokens += q
            self.attention_pairs += q * s - q * (q - 1) // 2  # contexts s-q+1 .. s
            self.kv_tokens_read += s

    def flops(self, shape: ModelShape) -> dict[str, float]:
        return {
            "linears": 2 * shape.linear_params * self.tokens,
            "attention": 4 * shape.attention_width * shape.num_layers * self.attention_pairs,
            "logits": 2 * shape.vocab_size * shape.hidden_size * self.logits_rows,
        }

    def bytes(self, shape: ModelShape) -> float:
        return (shape.weight_bytes * self.num_steps
                + shape.kv_bytes_per_token * self.kv_tokens_read)


@contextlib.contextmanager
def timed_steps(llm: LLM) -> Iterator[StepCounts]:
    """Counts and per-part timers on `llm`'s engine while the block runs."""
    counts = StepCounts()
    engine = llm.engine
    runner = engine.worker.model_runner
    seconds = counts.seconds

    active: list[str] = []  # the timed parts the running call is inside, outermost first

    def timer(part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if "logits" in active:  # the logits' packed GEMM is the logits' time, not linears'
                return fn(*args, **kwargs)
            active.append(part)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                active.pop()
        return timed

    run_model, step, attention = engine.worker.run_model, engine.step, decoder_module.paged_attention
    linear_call = PackedLinear.__call__
    sample, to_results = runner.sampler.sample_positions, runner.sampler.to_results
    compute_logits = runner.model.compute_logits

    def counted_run_model(prepared):
        if prepared.inputs is not None:
            counts.add_step(prepared.inputs.metadata, prepared.inputs.logits_rows.shape[0])
        return run_model(prepared)

    engine.worker.run_model = timer("forward and sampling", counted_run_model)
    engine.step = timer("step", step)
    decoder_module.paged_attention = timer("attention", attention)
    PackedLinear.__call__ = timer("linears", linear_call)
    runner.sampler.sample_positions = timer("sampling", sample)
    runner.sampler.to_results = timer("sampling", to_results)
    runner.model.compute_logits = timer("logits", compute_logits)
    try:
        yield counts
    finally:
        engine.worker.run_model, engine.step = run_model, step
        decoder_module.paged_attention = attention
        PackedLinear.__call__ = linear_call
        runner.sampler.sample_positions, runner.sampler.to_results = sample, to_results
        del runner.model.compute_logits


@dataclass
class WorkloadResult:
    name: str
    elapsed_s: float
    num_tokens: int
    counts: StepCounts
    shape: ModelShape
    all_tok_s: list[float] = field(default_factory=list)
    """tok/s of every run of the workload (`--repeats`), in order."""


def run_workload(name: str, model_dir: str, args) -> WorkloadResult:
    num_prompts, n, (shortest, longest), new_tokens = WORKLOADS[name]
    workload = argparse.Namespace(num_prompts=num_prompts, min_prompt_len=shortest,
                                  max_prompt_len=longest, seed=args.seed)
    prompts = make_prompts(workload, AutoConfig.from_pretrained(model_dir).vocab_size)
    dtype = DTYPES[args.dtype]
    max_len = longest + new_tokens + 16
    rows = num_prompts * n
    llm = LLM(model_dir, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size,
              max_num_seqs=rows, max_model_len=max_len, cpu_threads=args.threads,
              kv_cache_bytes=kv_cache_bytes_for(model_dir, rows, max_len, dtype))
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        params = SamplingParams(n=n, temperature=1.0, max_tokens=new_tokens, ignore_eos=True,
                                seed=args.seed)
        shape = ModelShape.of(llm, model_dir, dtype)
        with timed_steps(llm) as counts:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=True)
            elapsed = time.perf_counter() - start
    finally:
        llm.engine.shutdown()
    return WorkloadResult(name, elapsed, sum(len(c.token_ids) for o in outputs for c in o.outputs),
                          counts, shape)


# ------------------------------------------------------------------------------------ report
def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads", flush=True)
    gemms = {dtype: peak_gemm_flops(DTYPES[dtype], args.gemm_size) for dtype in DTYPES}
    peaks = {dtype: flops for dtype, (flops, _) in gemms.items()}
    bandwidth = peak_bandwidth()
    print("\n| peak | measured |\n|---|---:|")
    for dtype, (flops, size) in gemms.items():
        print(f"| GEMM {size}^3, {dtype} | {flops / 1e9:.1f} GFLOP/s |")
    print(f"| triad bandwidth | {bandwidth / 1e9:.1f} GB/s |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(build_tiny_model(
            Path(tmp) / "model", args.arch, args.size,
            max_position_embeddings=max(WORKLOADS[w][2][1] + WORKLOADS[w][3] for w in
                                        args.workloads) + 64))
        results = []
        for name in args.workloads:
            runs = []
            for index in range(args.repeats):
                runs.append(run_workload(name, model_dir, args))
                print(f"{name}, run {index + 1}/{args.repeats}: {runs[-1].elapsed_s:.1f} s",
                      flush=True)
            best = min(runs, key=lambda r: r.elapsed_s)
            best.all_tok_s = [r.num_tokens / r.elapsed_s for r in runs]
            results.append(best)
    # The linears' dtype: bfloat16 weights on a CPU without bfloat16 arithmetic run float32
    # GEMMs (`packed_linear.gemm_dtype`), so their peak is float32's.
    peak_dtype = str(gemm_dtype(DTYPES[args.dtype])).removeprefix("torch.")
    print_tables(results, peaks[peak_dtype], bandwidth, args.dtype, peak_dtype)


def print_tables(results: list[WorkloadResult], peak_flops: float, bandwidth: float,
                 dtype: str, peak_dtype: str) -> None:
    print(f"\nAchieved over the whole run, the fastest of each workload's runs ({dtype}; shares "
          f"of the measured {peak_dtype} GEMM peak and of the triad bandwidth):\n")
    print("| workload | tok/s | runs' tok/s | steps | GFLOP/s | % peak FLOP/s | GB/s | "
          "% bandwidth | FLOPs: linears / attention / logits |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        flops = r.counts.flops(r.shape)
        total = sum(flops.values())
        gbps = r.counts.bytes(r.shape) / r.elapsed_s / 1e9
        split = " / ".join(f"{v / total:.0%}" for v in flops.values())
        runs = ", ".join(f"{x:.0f}" for x in r.all_tok_s)
        print(f"| {r.name} | {r.num_tokens / r.elapsed_s:.0f} | {runs} | {r.counts.num_steps} | "
              f"{total / r.elapsed_s / 1e9:.1f} | {total / r.elapsed_s / peak_flops:.0%} | "
              f"{gbps:.1f} | {gbps * 1e9 / bandwidth:.0%} | {split} |")
    print("\nWhere the time went (share of the run's wall time; each part's own rate; attention's "
          "GB/s counts each sequence's KV whole, which a shared prefix read once can beat):\n")
    print("| workload | linears | attention | logits | sampling | other forward | host |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s, flops = r.counts.seconds, r.counts.flops(r.shape)
        other = s["forward and sampling"] - s["linears"] - s["attention"] - s["logits"] \
            - s["sampling"]
        host = r.elapsed_s - s["forward and sampling"]

        cells = [share(s["linears"], r.elapsed_s, flops["linears"]),
                 share(s["attention"], r.elapsed_s, flops["attention"],
                       r.shape.kv_bytes_per_token * r.counts.kv_tokens_read),
                 share(s["logits"], r.elapsed_s, flops["logits"]),
                 share(s["sampling"], r.elapsed_s), share(other, r.elapsed_s),
                 share(host, r.elapsed_s)]
        print(f"| {r.name} | {' | '.join(cells)} |")


def share(seconds: float, elapsed_s: float, flops: float | None = None,
          num_bytes: float | None = None) -> str:
    """A part's share of the wall time, and its own FLOP and byte rates where it has them."""
    rates = []
    if flops is not None and seconds > 0:
        rates.append(f"{flops / seconds / 1e9:.0f} GFLOP/s")
    if num_bytes is not None and seconds > 0:
        rates.append(f"{num_bytes / seconds / 1e9:.0f} GB/s")
    return f"{seconds / elapsed_s:.0%}" + (f" ({', '.join(rates)})" if rates else "")


if __name__ == "__main__":
    main()
