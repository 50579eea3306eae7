"""PPO-style RL through the rollout engine: TRL's GRPOTrainer teaches a random model to obey its prompt.

TRL removed its `PPOTrainer` in 2026; `GRPOTrainer` is the maintained trainer of that family:
PPO's clipped surrogate objective, with each completion's advantage taken relative to the
other completions of the same prompt (its group) instead of from a learned value model.
Here each rollout is optimised on once, so the policy ratio is 1 and the clipping never
binds (TRL's clip ratio, printed, stays 0): the update is a policy gradient with
group-relative advantages. `num_iterations > 1` in GRPOConfig reuses each rollout for
several passes, which is where the clip acts.

The trainer and the engine share the machine, in TRL's colocate choreography: each step the
engine generates, then sleeps (level 2: its weight and KV memory go back to the OS) while the
trainer trains; before the next rollout the engine wakes its weights, receives the trainer's
new ones, resets its prefix cache and wakes its KV cache. Both processes' memory is sampled
throughout, with each phase marked.

The task depends on the prompt and the reward is programmatic: a prompt starts with
"digits:" or "words:" (half each), and the reward is the fraction of completion tokens that
obey it (digit tokens, or tokens of a fixed list of words). A policy that ignores its prompt
earns at most 0.5; a random model starts near 0.05 and reaches 1.0 within 100 steps (about
45 s on two CPU cores), answering digits to one instruction and words to the other. TRL's
importance-sampling metrics (the engine's sampling logprobs against the trainer's) are
printed and plotted. Both sides run batch-invariant kernels (on the CPU, by default: the
engine serves with --batch-invariant, the trainer passes `batch_invariant=True`), so the
engine's logprob of every sampled token is the trainer's, bit for bit: the ratio is exactly 1
and the difference exactly 0 at every step (`--no-batch-invariant`: only close). The engine's weight and KV pools are plotted as `memory_state()` reports
them, leaving at every sleep and coming back at every wake.

    python examples/ppo_colocate.py                          # tiny model, engine started here
    python examples/ppo_colocate.py --model DIR --engine 127.0.0.1:50051
    accelerate launch --multi_gpu --num_processes 2 examples/ppo_colocate.py
        # two trainer processes (gloo on CPU), each with its own engine: one engine per device

Writes to --out (default out/): reward_curve.png (reward, importance-sampling ratio,
logprob difference, clip ratio), rewards.json, memory_timeline.json and memory_timeline.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from accelerate import PartialState
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as transformers_logging
from trl import GRPOConfig

from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.invariant_logps import engine_runs_batch_invariant
from trainer_bridge.server_process import EngineServer
from trainer_bridge.timeline import (
    STEP_PHASES,
    MemoryTimeline,
    pid_listening_on,
    plot_timeline,
)
from trainer_bridge.trl import EngineGRPOTrainer

# Words the tiny model's tokenizer encodes as one token each (" car" is one token), the
# answers "words:" asks for.
WORDS = (
    "a", "again", "an", "as", "be", "car", "do", "does", "ever", "for", "go", "hear", "in", "is",
    "list", "man", "mind", "no", "of", "on", "or", "plan", "read", "see", "set", "so", "the",
    "time", "to", "until", "us", "who",
)
NUM_REPORT_STEPS = 5  # "first steps" and "last steps" of the reward summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Hugging Face model dir (default: build a tiny llama)")
    parser.add_argument("--engine", help="address of a running engine (comma-separated, one per "
                        "trainer process); default: start one per process")
    parser.add_argument("--out", default=str(REPO_ROOT / "out"), help="output dir (default: out/)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=32, help="completions per step and process")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sleep-level", type=int, default=2, choices=[0, 1, 2],
                        help="engine sleep level while training; 0 never sleeps")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool of a started engine")
    parser.add_argument("--hz", type=float, default=50.0, help="memory samples per second")
    parser.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                        help="plain kernels on both sides: the logprobs are then only close "
                        "(default on the CPU: batch-invariant; an --engine's own mode is used)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads of the trainer and of a started engine: they share the "
                        "cores, and for a small model one thread each avoids OpenMP stalls")
    return parser.parse_args(argv)


def make_reward(tokenizer):
    """Reward by the prompt's instruction: "digits:" asks for digit tokens, "words:" for
    the words above; the fraction of completion tokens that comply."""
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    words = {i for w in WORDS for i in tokenizer(" " + w, add_special_tokens=False)["input_ids"]}
    if tokenizer.unk_token_id in digits or None in digits:
        raise ValueError("this tokenizer has no single-token digits; pick another model")

    def instruction_reward(completion_ids: list[list[int]], mode: list[str], **kwargs) -> list[float]:
        return [sum(t in (digits if m == "digits" else words) for t in ids) / max(len(ids), 1)
                for ids, m in zip(completion_ids, mode, strict=True)]

    return instruction_reward


def make_dataset(num_prompts: int, seed: int) -> Dataset:
    """Prompts "digits: w1 w2 w3" or "words: w1 w2 w3", half each, in random order."""
    rng = random.Random(seed)
    modes = [rng.choice(("digits", "words")) for _ in range(num_prompts)]
    prompts = [f"{m}: {' '.join(rng.sample(WORDS, 3))}" for m in modes]
    return Dataset.from_dict({"prompt": prompts, "mode": modes})


def prepare_model(args: argparse.Namespace, state: PartialState) -> Path:
    if args.model:
        return Path(args.model)
    model_dir = Path(args.out) / "model"
    if state.is_main_process:
        from rollout_engine.tiny_model import build_tiny_model

        build_tiny_model(model_dir, "llama", "tiny", seed=args.seed)
    state.wait_for_everyone()
    return model_dir


def connect_engine(args, state: PartialState, model_dir: Path) -> tuple[EngineClient, EngineServer | None, int | None]:
    """This process's engine: the given address, or a server started for it."""
    if args.engine:
        addresses = args.engine.split(",")
        if len(addresses) != state.num_processes:
            raise SystemExit(f"--engine needs one address per process ({state.num_processes})")
        address, server = addresses[state.process_index], None
        pid = pid_listening_on(int(address.rsplit(":", 1)[1]))
    else:
        server = EngineServer(model_dir, engine_options={
            "kv_cache_bytes": f"{args.kv_cache_mib}MiB", "seed": args.seed + state.process_index,
            "batch_invariant": args.batch_invariant,
        }, log_path=Path(args.out) / f"engine-rank{state.process_index}.log",
            env={"OMP_NUM_THREADS": str(args.threads)})
        address, pid = server.address, server.pid
    client = EngineClient(address, timeout=300)
    client.wait_until_ready(60)
    args.batch_invariant = engine_runs_batch_invariant(client)  # the trainer follows the engine
    return client, server, pid


# TRL's per-step metrics the demo keeps, printed and plotted.
METRICS = (
    "reward", "reward_std",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max", "clip_ratio/region_mean",
)


class RewardProgress(TrainerCallback):
    """A tqdm bar over optimizer steps showing the mean reward; keeps TRL's metrics."""

    def __init__(self, num_steps: int, is_main_process: bool) -> None:
        self.bar = tqdm(total=num_steps, desc="GRPO", unit="step", disable=not is_main_process)
        self.metrics: dict[str, list[float]] = {name: [] for name in METRICS}

    @property
    def rewards(self) -> list[float]:
        return self.metrics["reward"]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            for name in METRICS:
                self.metrics[name].append(float(logs.get(name, float("nan"))))
            self.bar.set_postfix(reward=f"{self.rewards[-1]:.3f}")
            self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def build_trainer(args, model_dir: Path, client: EngineClient, timeline, progress) -> EngineGRPOTrainer:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=args.batch,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        learning_rate=args.lr, lr_scheduler_type="constant", max_steps=args.steps, beta=0.0,

        logging_steps=1, report_to="none", save_strategy="no", seed=args.seed,
        use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True,
    )
    trainer = EngineGRPOTrainer(
        model=model, reward_funcs=make_reward(tokenizer), args=config,
        train_dataset=make_dataset(64 * args.steps, args.seed), processing_class=tokenizer,
        engine=client, sleep_level=args.sleep_level or None, timeline=timeline,
        batch_invariant=args.batch_invariant,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(progress)
    return trainer


def show_greedy(trainer: EngineGRPOTrainer, client: EngineClient, is_main_process: bool) -> None:
    """Serve the final policy (every process pushes: gathering weights may be collective) and
    print its greedy answers to two prompts."""
    version = trainer.sync_engine_weights()
    if not is_main_process:
        return
    prompts = ["digits: car the until", "words: car the until"]
    params = SamplingParams(temperature=0.0, max_tokens=trainer.args.max_completion_length)
    for prompt, output in zip(prompts, client.generate(prompts, params), strict=True):
        text = trainer.processing_class.decode(output.outputs[0].token_ids, skip_special_tokens=True)
        print(f"  {prompt!r} -> {text!r}  (weight version {version})")


def write_outputs(out: Path, progress: RewardProgress, timeline: MemoryTimeline, suffix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / f"rewards{suffix}.json").write_text(json.dumps(progress.metrics))
    metrics = progress.metrics
    steps = list(range(1, len(progress.rewards) + 1))
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    top.plot(steps, metrics["reward"], marker="o", ms=3, label="mean reward")
    low = [r - s for r, s in zip(metrics["reward"], metrics["reward_std"], strict=True)]
    high = [r + s for r, s in zip(metrics["reward"], metrics["reward_std"], strict=True)]
    top.fill_between(steps, low, high, alpha=0.2, label="± std over completions")
    top.set(ylabel="fraction of tokens obeying\nthe prompt's instruction", ylim=(-0.05, 1.05),
            title="GRPO through the rollout engine")
    top.legend(loc="upper left", fontsize=8)
    for key in ("min", "mean", "max"):
        middle.plot(steps, metrics[f"sampling/importance_sampling_ratio/{key}"], marker=".",
                    label=f"IS ratio {key}")
    exact = all(v == 0.0 for v in metrics["sampling/sampling_logp_difference/max"])
    middle.set(ylabel="engine vs trainer\nimportance-sampling ratio",
               title="batch-invariant: exactly 1 at every step" if exact else None)
    middle.legend(loc="upper left", fontsize=8)
    bottom.plot(steps, metrics["sampling/sampling_logp_difference/max"], marker=".",
                label="max |logp trainer - logp engine|")
    bottom.plot(steps, metrics["clip_ratio/region_mean"], marker=".",
                label="PPO clip ratio (region mean)")
    bottom.set(xlabel="optimizer step", ylabel="logp difference,\nclip ratio")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"reward_curve{suffix}.png", dpi=120)
    plt.close(fig)
    timeline.save_json(out / f"memory_timeline{suffix}.json", summary=timeline.summary())
    plot_timeline(timeline.to_dict(), out / f"memory_timeline{suffix}.png",
                  title="trainer and engine memory, GRPO steps (colocated)")


def finite_mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.mean(finite) if finite else float("nan")


def print_summary(progress: RewardProgress, timeline: MemoryTimeline, out: Path, suffix: str) -> bool:
    """Print the reward rise, TRL's sampling metrics, phase times, pool bytes and output
    paths; False if the reward fell short (judged only when the first and last
    NUM_REPORT_STEPS steps do not overlap)."""
    num_steps = min(NUM_REPORT_STEPS, len(progress.rewards) // 2) or 1
    first = statistics.mean(progress.rewards[:num_steps])
    last = statistics.mean(progress.rewards[-num_steps:])
    print(f"mean reward, first {num_steps} steps: {first:.3f}; last {num_steps} steps: {last:.3f}")
    metrics = progress.metrics
    print("importance-sampling ratio (engine vs trainer logprobs): mean "
          f"{finite_mean(metrics['sampling/importance_sampling_ratio/mean']):.6f}, min "
          f"{min(metrics['sampling/importance_sampling_ratio/min']):.6f}, max "
          f"{max(metrics['sampling/importance_sampling_ratio/max']):.6f}; "
          f"max |logp difference| {max(metrics['sampling/sampling_logp_difference/max']):.2e}; "
          f"PPO clip ratio (mean) {finite_mean(metrics['clip_ratio/region_mean']):.4f}")
    exact = all(v == 0.0 for v in metrics["sampling/sampling_logp_difference/max"]) and all(
        v == 1.0 for key in ("min", "max")
        for v in metrics[f"sampling/importance_sampling_ratio/{key}"])
    print("engine logprobs equal to the trainer's, bit for bit, at every step (IS ratio exactly "
          f"1, difference exactly 0): {'yes' if exact else 'no'}")
    summary = timeline.summary()
    split = ", ".join(f"{name} {summary['phases'][name]['median_duration_s'] * 1e3:.0f} ms"
                      for name in STEP_PHASES if name in summary["phases"])
    print(f"median phase times: {split}")
    released = summary.get("pool_bytes_released_per_sleep")
    if released:
        print(f"engine pools released per sleep: {released / 2**20:.0f} MiB "
              f"(memory_state(), weights + KV cache)")
    print(f"combined peak memory: {summary['combined_peak_bytes'] / 2**20:.0f} MiB "
          f"({summary['samples_per_s']:.0f} samples/s)")
    for name in ("reward_curve", "memory_timeline"):
        print(f"wrote {out / f'{name}{suffix}.png'}")
    print(f"wrote {out / f'memory_timeline{suffix}.json'}")
    return last > first or len(progress.rewards) < 2 * NUM_REPORT_STEPS


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed APIs
    transformers_logging.disable_progress_bar()
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    else:
        args.batch_invariant = False  # the batch-invariant kernels are CPU-only so far
    state = PartialState(cpu=not torch.cuda.is_available())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args, state)
    client, server, engine_pid = connect_engine(args, state, model_dir)
    pids = {"trainer": os.getpid(), **({"engine": engine_pid} if engine_pid else {})}
    timeline = MemoryTimeline(pids, hz=args.hz).start()
    progress = RewardProgress(args.steps, state.is_main_process)
    try:
        trainer = build_trainer(args, model_dir, client, timeline, progress)
        trainer.train()
        show_greedy(trainer, client, state.is_main_process)
        fingerprint = sum(float(p.detach().double().sum()) for p in trainer.model.parameters())
        print(f"rank {state.process_index}: engine {client.address} (pid {engine_pid}), "
              f"weight_version {client.info().weight_version}, "
              f"policy fingerprint {fingerprint:.6f}", flush=True)
    finally:
        timeline.stop()
        client.close()
        if server is not None:
            server.stop()
    suffix = f"-rank{state.process_index}" if state.num_processes > 1 else ""
    write_outputs(out, progress, timeline, suffix)
    if not state.is_main_process:
        return 0
    if print_summary(progress, timeline, out, suffix):
        return 0
    print("the reward did not rise: try more --steps or a larger --lr", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
