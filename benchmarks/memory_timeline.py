"""Memory timeline of a colocated GRPO loop (TRL + the engine) with the engine's sleep off, level 1 and level 2.

Each configuration runs the loop of `examples/ppo_colocate.py` (GRPOTrainer through the
engine) in a fresh trainer process with a fresh engine server, sampling both processes'
memory (resident bytes on CPU; device bytes per process through NVML on CUDA) at --hz,
with every phase marked: generate, sleep, train, wake_weights, weight_sync,
reset_prefix_cache, wake_kv_cache.

Sleeping pays off when the trainer's transient memory (gradients, activations) would
otherwise sit on top of the engine's weights and KV cache: the combined peak drops by
min(trainer transient, engine weights + KV). Level 1 keeps a host copy of the weights, so on
CPU it only frees the KV cache; level 2 frees both. The claim checked here: with level 2
the combined peak is lower than with sleep off by at least 90% of the engine's weight + KV
pool bytes.

    python -m benchmarks.memory_timeline                      # "small" model, 256 MiB KV pool
    python -m benchmarks.memory_timeline --size tiny --kv-cache-mib 16 --steps 2   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO_ROOT
from trainer_bridge.timeline import PHASE_COLORS, STEP_PHASES

MiB = 2**20
CONFIGS = {"sleep off": None, "sleep level 1": 1, "sleep level 2": 2}
GOAL_FRACTION = 0.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face model dir (default: build --size)")
    parser.add_argument("--size", default="small", help="size preset of the built llama")
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per configuration")
    parser.add_argument("--batch", type=int, default=32, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--hz", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of the trainer and of the engine (they share the cores; "
                        "more threads stall in OpenMP on a busy 2-core machine)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    parser.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "config name=result path"
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ one config


def run_config(args: argparse.Namespace, model_dir: Path, sleep_level: int | None) -> dict:
    """The GRPO loop with one sleep level, in this process; the timeline and pool bytes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from examples.ppo_colocate import make_dataset, make_reward
    from trainer_bridge import EngineClient
    from trainer_bridge.server_process import EngineServer
    from trainer_bridge.timeline import MemoryTimeline
    from trainer_bridge.trl import EngineGRPOTrainer

    torch.manual_seed(0)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    with EngineServer(model_dir, engine_options={"kv_cache_bytes": f"{args.kv_cache_mib}MiB"},
                      log_path=Path(args.out) / f"engine-level{sleep_level or 0}.log",
                      env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        client = EngineClient(server.address, timeout=600)
        pool_bytes = client.memory_state().pool_bytes
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
            num_generations=args.num_generations, max_completion_length=args.max_completion_length,
            generation_kwargs={"ignore_eos": True}, learning_rate=1e-3, max_steps=args.steps,
            beta=0.0, logging_steps=1, report_to="none", save_strategy="no", seed=0,
            use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True,
        )
        timeline = MemoryTimeline({"trainer": os.getpid(), "engine": server.pid}, hz=args.hz)
        trainer = EngineGRPOTrainer(
            model=model, reward_funcs=make_reward(tokenizer), args=config,
            train_dataset=make_dataset(args.batch * args.steps, 0), processing_class=tokenizer,
            engine=client, sleep_level=sleep_level, timeline=timeline,
        )
        trainer.remove_callback(PrinterCallback)
        with timeline:
            trainer.train()
            timeline.end_all()
        client.close()
    return {"sleep_level": sleep_level, "pool_bytes": pool_bytes,
            "timeline": timeline.to_dict(), "summary": timeline.summary()}


def run_in_subprocess(args: argparse.Namespace, name: str, model_dir: Path) -> dict:
    """One configuration in a fresh trainer process, so no run inherits another's heap."""
    result_path = Path(args.out) / f"run-level{CONFIGS[name]}.json"
    # Same cwd and environment as this process, so the package imports as it did here.
    command = [sys.executable, "-m", "benchmarks.memory_timeline", "--worker",
               f"{name}={result_path}", "--model", str(model_dir), *_forwarded(args)]
    subprocess.run(command, check=True)
    return json.loads(result_path.read_text())


def _forwarded(args: argparse.Namespace) -> list[str]:
    names = ("kv_cache_mib", "steps", "batch", "num_generations", "max_completion_length", "hz",
             "threads", "out")
    return [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names]


# --------------------------------------------------------------------------------- report


def report(results: dict[str, dict]) -> tuple[str, bool | None]:
    """Markdown tables and whether the 90% claim holds (None: a configuration is missing)."""
    first = next(iter(results.values()))
    engine_bytes = sum(first["pool_bytes"].values())
    lines = [
        (f"engine pools: weights {first['pool_bytes']['weights'] / MiB:.1f} MiB + KV "
         f"{first['pool_bytes']['kv_cache'] / MiB:.1f} MiB = {engine_bytes / MiB:.1f} MiB"), "",
        ("| config | combined peak (MiB) | trainer peak | engine peak | below sleep off "
         "| / engine pools | samples/s |"), "|---|---:|---:|---:|---:|---:|---:|",
    ]
    off_peak = results.get("sleep off", {}).get("summary", {}).get("combined_peak_bytes")
    for name, result in results.items():
        summary = result["summary"]
        peak = summary["combined_peak_bytes"]
        saved = (off_peak - peak) if off_peak is not None else None
        lines.append(
            f"| {name} | {peak / MiB:.0f} | {summary['peak_bytes']['trainer'] / MiB:.0f} | "
            f"{summary['peak_bytes']['engine'] / MiB:.0f} | "
            + (f"{saved / MiB:.0f} | {saved / engine_bytes:.0%}" if saved is not None else "- | -")
            + f" | {summary['samples_per_s']:.0f} |")
    lines += ["", ("Per phase (median over steps): latency, and memory the engine freed "
                   "(negative: took back)"), "",
              "| config | " + " | ".join(STEP_PHASES) + " |", "|---|" + "---:|" * len(STEP_PHASES)]
    for name, result in results.items():
        phases = result["summary"]["phases"]
        cells = []
        for phase in STEP_PHASES:
            p = phases.get(phase)
            cells.append("-" if p is None else f"{p['median_duration_s'] * 1e3:.0f} ms, "
                         f"{p['median_freed_bytes']['engine'] / MiB:+.0f} MiB")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *step_split(results)]
    level2 = results.get("sleep level 2")
    if off_peak is None or level2 is None:
        return "\n".join(lines), None
    saved = off_peak - level2["summary"]["combined_peak_bytes"]
    holds = saved >= GOAL_FRACTION * engine_bytes
    lines += ["", (f"sleep level 2 lowers the combined peak by {saved / MiB:.0f} MiB = "
                   f"{saved / engine_bytes:.0%} of the engine's weight + KV pools (goal >= "
                   f"{GOAL_FRACTION:.0%}): {'PASS' if holds else 'FAIL'}")]
    return "\n".join(lines), holds


def step_split(results: dict[str, dict]) -> list[str]:
    """Time split of one step (medians), for each configuration."""
    lines = ["Time split of one step (median ms, share of the step)", "",
             "| config | " + " | ".join(STEP_PHASES) + " | step |",
             "|---|" + "---:|" * (len(STEP_PHASES) + 1)]
    for name, result in results.items():
        phases = result["summary"]["phases"]
        times = {p: phases[p]["median_duration_s"] if p in phases else 0.0 for p in STEP_PHASES}
        total = sum(times.values())
        cells = [f"{times[p] * 1e3:.0f} ({times[p] / total:.0%})" for p in STEP_PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {total * 1e3:.0f} |")
    return lines


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.2 * len(results)), sharey=True,
                             squeeze=False)
    for ax, (name, result) in zip(axes[:, 0], results.items(), strict=True):
        data = result["timeline"]
        total = None
        for role in data["rss_bytes"]:
            values = [(r + d) / MiB for r, d in zip(data["rss_bytes"][role],
                                                    data["device_bytes"][role], strict=True)]
            total = values if total is None else [a + b for a, b in zip(total, values, strict=True)]
            ax.plot(data["time_s"], values, lw=1, label=role)
        ax.plot(data["time_s"], total, lw=1.5, color="black", label="combined")
        for phase in data["phases"]:
            if phase["name"] in ("generate", "train", "sleep", "weight_sync"):
                ax.axvspan(phase["start_s"], phase["end_s"], alpha=0.15, lw=0,
                           color=PHASE_COLORS[phase["name"]])
        ax.set_title(f"{name}: combined peak {result['summary']['combined_peak_bytes'] / MiB:.0f} MiB"
                     " (shaded: green generate, blue train, red sleep, purple weight sync)",
                     fontsize=9)
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        name, result_path = args.worker.split("=", 1)
        result = run_config(args, Path(args.model), CONFIGS[name])
        Path(result_path).write_text(json.dumps(result))
        return 0
    model_dir = Path(args.model) if args.model else _build_model(args.size, out)
    names = [n.strip() for n in args.configs.split(",")]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    results = {name: run_in_subprocess(args, name, model_dir) for name in names}
    table, holds = report(results)
    (out / "memory_timeline.json").write_text(json.dumps(results))
    plot(results, out / "memory_timeline.png")
    print(table)
    print(f"\nwrote {out / 'memory_timeline.json'} and {out / 'memory_timeline.png'}")
    return 0 if holds is not False else 1


def _build_model(size: str, out: Path) -> Path:
    from rollout_engine.tiny_model import build_tiny_model

    return build_tiny_model(out / f"model-{size}", "llama", size, seed=0)


if __name__ == "__main__":
    raise SystemExit(main())
