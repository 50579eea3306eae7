"""What several benchmarks share: model and GRPO-workload options, prompts, and the competitors."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# Competitors live in venvs of their own (`make peers`), never in ours.
VLLM_PYTHON = REPO_ROOT / ".peers" / "vllm" / "bin" / "python"
# Run by VLLM_PYTHON as a plain script: it imports vLLM only, never this package.
_VLLM_SCRIPT = Path(__file__).resolve().parent / "peers" / "vllm_generate.py"

R = TypeVar("R")


def add_model_args(parser: argparse.ArgumentParser, arch: str = "qwen2") -> None:
    """--model (a Hugging Face directory) or a model built from --arch and --size."""
    parser.add_argument("--model", help="Hugging Face model dir (default: build --arch/--size)")
    parser.add_argument("--arch", default=arch, help="architecture of the built model")
    parser.add_argument("--size", default="small", help="size preset of the built model")


def add_vllm_modes_arg(parser: argparse.ArgumentParser, default: list[str]) -> None:
    """--vllm-modes: which of vLLM's CPU build's runs, eager and/or compiled (torch.compile, its
    default)."""
    parser.add_argument("--vllm-modes", nargs="+", default=default,
                        choices=["eager", "compiled"],
                        help="vLLM runs: eager and/or compiled (torch.compile, its default)")


def add_grpo_workload_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """A GRPO batch: prompts of random lengths, n samples each, a fixed number of new tokens."""
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group size)")
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--seed", type=int, default=0)


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """`args.num_prompts` prompts of random token ids (never the special ids 0-2)."""
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab_size)
         for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
        for _ in range(args.num_prompts)
    ]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [num_prompts, longest] of one left-padded batch (pad id 0),
    as Hugging Face `generate` takes them."""
    import torch

    max_len = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), max_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, max_len - len(p):] = torch.tensor(p)
        mask[i, max_len - len(p):] = 1
    return input_ids, mask


def kv_bytes_per_token(model_dir: str, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes in the model, as the engine lays its cache out."""
    from transformers import AutoConfig

    from rollout_engine.worker.kv_cache_spec import KVCacheSpec

    config = AutoConfig.from_pretrained(model_dir)
    return KVCacheSpec.from_model(config, block_size=1, dtype=dtype).bytes_per_token


def kv_cache_bytes_for(model_dir: str, num_rows: int, max_len: int,
                       dtype: torch.dtype | None = None) -> int:
    """A KV pool with room for every row's whole sequence (no preemption), plus a little."""
    import torch

    per_token = kv_bytes_per_token(model_dir, dtype or torch.float32)
    return int(per_token * num_rows * (max_len + 32) * 1.1)


def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def vllm_missing_note() -> str:
    return f"vLLM's CPU build is not installed ({VLLM_PYTHON} missing): `make peers` adds it"


def run_vllm(
    model_dir: str,
    prompts: list[list[int]],
    *,
    n: int,
    max_tokens: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    threads: int | None = None,
    repeats: int = 1,
    kv_cache_gib: int = 4,
    dtype: str = "float32",
    enforce_eager: bool = False,
    greedy: bool = False,
    timeout_s: float = 3600.0,
    lora_paths: list[str] | None = None,
    max_lora_rank: int = 16,
    moe_lora_3d: bool = False,
) -> dict:
    """{"elapsed_s": [one per repeat], "num_tokens": N, "version": ...} of vLLM generating the
    same workload (unseeded, EOS ignored) in a child process of its own venv; compiled (vLLM's
    default) unless `enforce_eager`. `greedy`: one greedy sample per prompt instead, and
    "token_ids" (one list per prompt) in the answer. `lora_paths`: PEFT adapters, prompt i
    under adapter i % len (vLLM's enable_lora, max_loras = their number); `moe_lora_3d`: they
    adapt a MoE's fused 3-d expert weights (PEFT's `target_parameters`)."""
    job = {"model": model_dir, "prompts": prompts, "n": n, "max_tokens": max_tokens,
           "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens,
           "threads": threads, "repeats": repeats, "max_num_seqs": max(256, len(prompts) * n),
           "kv_cache_gib": kv_cache_gib, "dtype": dtype, "enforce_eager": enforce_eager,
           "greedy": greedy, "lora_paths": lora_paths or [], "max_lora_rank": max_lora_rank,
           "moe_lora_3d": moe_lora_3d}
    return run_vllm_script(_VLLM_SCRIPT, job, timeout_s)


def run_vllm_script(script: Path, job: dict, timeout_s: float = 3600.0) -> dict:
    """The JSON answer (its stdout's last line) of a script of `benchmarks/peers` run by vLLM's
    venv on `job` (given as a JSON file); RuntimeError with its stderr's tail if it fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        result = subprocess.run([str(VLLM_PYTHON), str(script), f.name],
                                capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"vLLM failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


class VllmServer:
    """`vllm serve` (its OpenAI server) from `.peers/vllm` on a free loopback port, for
    benchmarks that compare HTTP front-ends; `base_url` once /health answers. float32, prefix
    caching on, the KV space and OpenMP cores set as `run_vllm` sets them."""

    def __init__(self, model_dir: str, *, max_model_len: int, max_num_batched_tokens: int,
                 max_num_seqs: int, threads: int | None = None, kv_cache_gib: int = 4,
                 log_path: str | None = None, startup_timeout_s: float = 900.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # Dev mode serves /reset_prefix_cache, which benchmarks call between modes.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
               "VLLM_SERVER_DEV_MODE": "1"}
        if threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        self._log = open(log_path or os.devnull, "w")  # noqa: SIM115 - lives with the server
        self.process = subprocess.Popen(
            # The `vllm` script looks up a distribution named "vllm" (this one is "vllm-cpu"):
            # its API server module takes `vllm serve`'s options.
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--max-model-len", str(max_model_len),
             "--max-num-batched-tokens", str(max_num_batched_tokens),
             "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching", *extra_args],
            env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve did not start (see {log_path or 'its log'})")

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def run_rounds(systems: dict[str, Callable[[], R]], repeats: int,
               elapsed_of: Callable[[R], float], label: str = "") -> dict[str, R]:
    """Every system once per round, rounds in turn; each system's best round (least
    `elapsed_of`) is kept. A system that raises is reported and left out of that round.

    A shared machine's speed drifts by 20% over minutes: alternating and keeping the best
    compares the systems at the machine's speed, not at whatever load each met.
    """
    results: dict[str, R] = {}
    for round_index in range(repeats):
        for name, run in systems.items():
            try:
                result = run()
            except Exception as exc:  # noqa: BLE001 - report, do not hide: the table says it failed
                print(f"{name}{label} failed: {type(exc).__name__}: {exc}")
                continue
            elapsed = elapsed_of(result)
            print(f"round {round_index + 1}/{repeats}: {name}{label}: {elapsed:.1f} s", flush=True)
            if name not in results or elapsed < elapsed_of(results[name]):
                results[name] = result
    return results
