"""Agentic multi-turn rollouts over HTTP: token-in chat against re-rendering the conversation.

`--conversations` conversations (default 64) of `--turns` turns (default 8) run at once against
one `rollout-engine serve --http-port` process, each in its own thread: the policy answers
(`--answer-chars` characters then EOS, streamed), a tool takes `--tool-latency-ms` and answers with
50 to 500 tokens of text, and the next turn is sent. Two modes, run in turn on the same
conversations (same tool answers, same seeds), the prefix cache reset before each:

- token-in: `POST /v1/chat/completions/tokens` with the previous turn's prompt and completion
  ids (`tokens`), each turn asking the engine to keep its KV for the next (`kv_keep_alive_s`);
- re-render: `POST /v1/chat/completions` with the whole conversation, rendered and tokenized
  again each turn (what a client that keeps messages does).

Per turn: the prompt tokens the engine prefilled (prompt - `cached_tokens`), the prompt tokens
that are new (past the longest common prefix with the previous turn's prompt and completion
ids), and the time to the first
token. Per conversation, training samples as TRL's AsyncGRPO reconciler counts them (a new
sample each time a turn's prompt does not extend the previous ids). The KV pool is sized to
`--kv-fraction` of the tokens all conversations hold at their end (1.2: the cache is ~85% full
at the end, and new turns' allocations evict the free queue's oldest blocks).

Goals (issue "token-exact multi-turn rollouts"): prefill on turn k equals its new tokens (within
a block), TTFT at the last turn within 1.2x of the first, samples per rollout exactly 1.00.

    python -m benchmarks.multi_turn                        # tiny model, 64 x 8
    python -m benchmarks.multi_turn --conversations 16 --turns 4    # a quick look

With vLLM's CPU build installed (`make peers`), the re-render mode also runs against `vllm serve`
on the same model (after ours has stopped; prefix caching on, its KV space 1 GiB, more than our
pool): vLLM has no token-in route, so re-rendering is what its clients do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.common import VllmServer, kv_bytes_per_token, vllm_available, vllm_missing_note
from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge.server_process import EngineServer

BLOCK = 16
TEMPLATE = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n"
            "{% endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}")
"""Qwen-style: each message closed by the end-of-turn token (here EOS)."""
WORDS = ("the", "file", "holds", "a", "list", "of", "values", "and", "test", "reads", "them",
         "back", "in", "order", "while", "tool", "prints", "each", "path", "it", "visits",
         "with", "its", "size", "time")


@dataclass
class TurnStats:
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    ttft_s: float


@dataclass
class Conversation:
    turns: list[TurnStats] = field(default_factory=list)
    num_samples: int = 1


def tool_answer(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 500) // 2))


def stream_turn(session: requests.Session, url: str, body: dict) -> tuple[dict, float]:
    """POST a streamed chat request; (the assembled answer, seconds to the first token)."""
    start = time.perf_counter()
    first_token_s = None
    answer = {"text": "", "token_ids": [], "prompt_token_ids": None, "usage": None}
    with session.post(url, json=body, stream=True, timeout=600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text}")
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if chunk.get("prompt_token_ids"):
                answer["prompt_token_ids"] = chunk["prompt_token_ids"]
            if chunk.get("usage"):
                answer["usage"] = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if (delta.get("content") or choice.get("token_ids")) and first_token_s is None:
                    first_token_s = time.perf_counter() - start
                answer["text"] += delta.get("content") or ""
                answer["token_ids"] += choice.get("token_ids") or []
    return answer, first_token_s if first_token_s is not None else time.perf_counter() - start


def run_conversation(base_url: str, model: str, index: int, args, token_in: bool
                     ) -> Conversation:
    rng = random.Random(args.seed * 1000 + index)
    messages = [{"role": "user", "content": f"Task {index}: " + tool_answer(rng)[:200]}]
    conversation, history = Conversation(), None
    with requests.Session() as session:
        for turn in range(args.turns):
            # The answer ends with the model's end of turn (EOS) once its regex is done, as a
            # trained policy's does; lowercase ASCII keeps its text its tokens' own.
            body = {"model": model, "messages": messages, "max_tokens": 4 * args.answer_chars,
                    "temperature": 1.0, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True,
                    "structured_outputs": {"regex": f"[a-z ]{{{args.answer_chars}}}"}}
            if not getattr(args, "unseeded", False):
                body["seed"] = args.seed + 31 * index + turn
            path = "/v1/chat/completions"
            if token_in:
                body["kv_keep_alive_s"] = 30.0
                if history is not None:
                    body, path = {**body, "tokens": history}, "/v1/chat/completions/tokens"
            answer, ttft = stream_turn(session, base_url + path, body)
            prompt = answer["prompt_token_ids"] or []
            usage = answer["usage"]
            cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            kept = common_prefix_len(prompt, history or [])
            if history is not None and kept < len(history):
                conversation.num_samples += 1  # the reconciler would fork (or realign) here
            new = len(prompt) - kept
            conversation.turns.append(TurnStats(usage["prompt_tokens"], cached, new, ttft))
            history = prompt + answer["token_ids"]
            messages = [*messages, {"role": "assistant", "content": answer["text"]},
                        {"role": "user", "content": "Tool output: " + tool_answer(rng)}]
            time.sleep(rng.uniform(0, args.tool_latency_ms / 1000 * 2))
    return conversation


def common_prefix_len(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_mode(base_url: str, model: str, args, token_in: bool, label: str) -> list[Conversation]:
    """All conversations at once, after a short warm-up (first requests pay one-time costs:
    the answer grammar, allocations) and with the prefix cache reset."""
    warm_up = argparse.Namespace(**{**vars(args), "turns": 2, "seed": args.seed + 1})
    for index in range(2):
        run_conversation(base_url, model, index, warm_up, token_in)
    requests.post(base_url + "/reset_prefix_cache", timeout=60)
    with concurrent.futures.ThreadPoolExecutor(args.conversations) as pool:
        futures = [pool.submit(run_conversation, base_url, model, i, args, token_in)
                   for i in range(args.conversations)]
        return [f.result() for f in tqdm(futures, desc=label)]


def per_turn(conversations: list[Conversation], turns: int) -> list[dict]:
    rows = []
    for k in range(turns):
        stats = [c.turns[k] for c in conversations]
        rows.append({
            "turn": k + 1,
            "prefill": statistics.mean(s.prompt_tokens - s.cached_tokens for s in stats),
            "new": statistics.mean(s.new_tokens for s in stats),
            "ttft_ms": 1000 * statistics.median(s.ttft_s for s in stats),
        })
    return rows


def report(results: dict[str, list[Conversation]], args) -> None:
    tables = {label: per_turn(c, args.turns) for label, c in results.items()}
    print(f"\n{args.conversations} conversations x {args.turns} turns, answers of "
          f"{args.answer_chars} characters + EOS, tool answers of 50-500 tokens")
    header = "turn | " + " | ".join(f"{m} prefill | {m} new | {m} TTFT ms" for m in tables)
    print(header)
    print("|".join("---" for _ in header.split("|")))
    for k in range(args.turns):
        cells = [str(k + 1)]
        for rows in tables.values():
            row = rows[k]
            cells += [f"{row['prefill']:.0f}", f"{row['new']:.0f}", f"{row['ttft_ms']:.0f}"]
        print(" | ".join(cells))
    for label, conversations in results.items():
        rows = tables[label]
        excess = max(r["prefill"] - r["new"] for r in rows[1:]) if len(rows) > 1 else 0.0
        samples = statistics.mean(c.num_samples for c in conversations)
        print(f"{label}: samples per rollout {samples:.2f}; TTFT last/first turn "
              f"{rows[-1]['ttft_ms'] / rows[0]['ttft_ms']:.2f}x; largest prefill beyond the "
              f"new tokens {excess:.0f} tokens (goal: < {BLOCK})")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for label, rows in tables.items():
            turns = [r["turn"] for r in rows]
            left.plot(turns, [r["prefill"] for r in rows], marker="o", label=f"{label} prefill")
            right.plot(turns, [r["ttft_ms"] for r in rows], marker="o", label=label)
        left.plot(turns, [r["new"] for r in tables[next(iter(tables))]], "k--",
                  label="new tokens (token-in)")
        left.set(xlabel="turn", ylabel="tokens per turn (mean)", title="prefill by turn")
        right.set(xlabel="turn", ylabel="median TTFT (ms)", title="time to first token")
        left.legend()
        right.legend()
        figure.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.plot)
        print(f"plot: {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--answer-chars", type=int, default=80,
                        help="characters of each answer (then EOS)")
    parser.add_argument("--tool-latency-ms", type=float, default=50.0)
    parser.add_argument("--kv-fraction", type=float, default=1.2,
                        help="KV pool / tokens all conversations hold at their end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="tiny", help="size preset of the built model")
    parser.add_argument("--skip-vllm", action="store_true",
                        help="do not run re-render against vllm serve even if it is installed")
    parser.add_argument("--threads", type=int, default=2, help="vllm serve's OpenMP threads")
    parser.add_argument("--plot", default="benchmarks/results/multi_turn.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # Heads of 32 dimensions (the tiny preset's 16 are below vLLM's CPU kernels' smallest).
        heads = {"num_attention_heads": 2, "num_key_value_heads": 1} if args.size == "tiny" else {}
        model_dir = build_tiny_model(Path(tmp) / "model", "qwen2", args.size, seed=0,
                                     max_position_embeddings=8192, **heads)
        (Path(model_dir) / "chat_template.jinja").write_text(TEMPLATE)
        import torch

        final_tokens = args.conversations * args.turns * (args.answer_chars // 2 + 300)
        kv_bytes = int(args.kv_fraction * final_tokens
                       * kv_bytes_per_token(str(model_dir), torch.float32))
        print(f"KV pool: {kv_bytes / 2**20:.0f} MiB, {args.kv_fraction:.0%} of the "
              f"~{final_tokens} tokens the conversations end with")
        with EngineServer(model_dir, engine_options={"kv_cache_bytes": kv_bytes,
                                                     "max_model_len": 8192},
                          extra_args=["--http-port", "0", "--served-model-name", "model"],
                          log_path=Path(tmp) / "server.log") as server:
            base_url = server.http_url
            results = {
                "token-in": run_mode(base_url, "model", args, True, "token-in"),
                "re-render": run_mode(base_url, "model", args, False, "re-render"),
            }
        if args.skip_vllm:
            pass
        elif vllm_available():
            vllm = VllmServer(str(model_dir), max_model_len=8192, max_num_batched_tokens=8192,
                              max_num_seqs=args.conversations, threads=args.threads,
                              kv_cache_gib=1, log_path=str(Path(tmp) / "vllm.log"),
                              extra_args=("--enable-prompt-tokens-details",))
            try:
                # Unseeded: vLLM 0.32's CPU worker fails seeded requests in a mixed batch
                # ("CPU Generator does not use offset") and its engine dies.
                unseeded = argparse.Namespace(**{**vars(args), "unseeded": True})
                results["vllm re-render"] = run_mode(vllm.base_url, str(model_dir), unseeded,
                                                     False, "vllm re-render")
            except RuntimeError as error:  # its engine died: say why, keep our figures
                log = (Path(tmp) / "vllm.log").read_text().splitlines()
                print(f"vllm serve failed: {error}\n" + "\n".join([
                    line for line in log if "Error" in line and "serving" not in line][-5:]))
            finally:
                vllm.stop()
        else:
            print(f"vllm serve skipped: {vllm_missing_note()}")
    report(results, args)


if __name__ == "__main__":
    main()
