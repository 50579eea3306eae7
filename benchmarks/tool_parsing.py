"""What parsing tool calls and reasoning costs: streamed parse cost per token as generations
grow (ours is incremental: flat in length; replaying the text at every chunk, as vLLM's
disaggregated streaming parse does, is quadratic), and a chat request through `serve` with
the parsers at work against the same request without them.

Rows:
- streaming parse: a synthetic Qwen3-style answer (reasoning, text, hermes tool calls) of 1k to
  8k tokens, fed in 4-character pieces (about a token each) to one `ChatParser`, against a
  fresh parse of the whole text so far at every piece (the replay); microseconds per token.
- chat overhead: the same chat request with tools (n samples, temperature 1) to one server
  with `--tool-call-parser hermes --reasoning-parser qwen3`, `tool_choice` "auto" (parsed)
  and "none" (not parsed, same prompt), alternating; goal: within 5% (wall time).

    python -m benchmarks.tool_parsing
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from rollout_engine.parsing import ChatParsing
from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge.server_process import EngineServer

CHARS_PER_TOKEN = 4
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]
CHAT_TEMPLATE = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                 "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "<|assistant|>")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="generation lengths in tokens")
    parser.add_argument("--num-requests", type=int, default=16, help="chat requests per row")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--skip-server", action="store_true", help="only the streaming rows")
    return parser.parse_args()


def synthetic_answer(num_tokens: int, seed: int = 0) -> str:
    """Reasoning for a quarter of the text, then prose with a tool call every ~400 tokens."""
    rng = random.Random(seed)
    words = ["the", "model", "calls", "a", "tool", "<b>", "x<y", "json", "{", "}", "\n"]
    num_chars = num_tokens * CHARS_PER_TOKEN
    thought = " ".join(rng.choice(words) for _ in range(num_chars // 16))
    parts, size = [f"<think>\n{thought}\n</think>\n\n"], len(thought)
    while size < num_chars:
        prose = " ".join(rng.choice(words) for _ in range(300))
        call = json.dumps({"name": "search", "arguments": {"query": prose[:40]}})
        parts += [prose, f"\n<tool_call>\n{call}\n</tool_call>\n"]
        size += len(prose) + len(call) + 30
    return "".join(parts)[:num_chars]


def streamed_us_per_token(text: str, replay: bool) -> float:
    parsing = ChatParsing("qwen3", "hermes")
    pieces = [text[i:i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]
    start = time.perf_counter()
    if replay:
        for end in range(1, len(pieces) + 1):
            parsing.parser("", TOOLS, True).parse("".join(pieces[:end]))
    else:
        parser = parsing.parser("", TOOLS, True)
        for piece in pieces:
            parser.feed(piece)
        parser.finish()
    return (time.perf_counter() - start) / len(pieces) * 1e6


def streaming_rows(lengths: list[int]) -> None:
    print(f"\nstreaming parse (qwen3 reasoning + hermes calls), {CHARS_PER_TOKEN}-char pieces\n")
    print("| tokens | incremental us/token | replay us/token | replay / ours |")
    print("|---:|---:|---:|---:|")
    streamed_us_per_token(synthetic_answer(256), replay=False)  # warm-up: regexes, imports
    for length in tqdm(lengths, desc="lengths", leave=False):
        text = synthetic_answer(length)
        ours = min(streamed_us_per_token(text, replay=False) for _ in range(3))
        replay = streamed_us_per_token(text, replay=True)
        print(f"| {length:,} | {ours:.2f} | {replay:.1f} | {replay / ours:.0f}x |")


def chat_overhead_rows(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", "qwen2", "small")
        server = EngineServer(model_dir, engine_options={"max_model_len": 512},
                              extra_args=["--http-port", "0", "--enable-auto-tool-choice",
                                          "--tool-call-parser", "hermes", "--reasoning-parser",
                                          "qwen3", "--trust-request-chat-template"],
                              log_path=Path(tmp) / "server.log")
        try:
            session = requests.Session()
            body = {"messages": [{"role": "user", "content": "find something"}],
                    "tools": TOOLS, "chat_template": CHAT_TEMPLATE, "n": args.n,
                    "temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
            times = {"none": [], "auto": []}
            for _ in tqdm(range(args.num_requests + 1), desc="chat requests", leave=False):
                for choice, samples in times.items():
                    start = time.perf_counter()
                    response = session.post(f"{server.http_url}/v1/chat/completions",
                                            json={**body, "tool_choice": choice}, timeout=600)
                    response.raise_for_status()
                    samples.append(time.perf_counter() - start)
            none, auto = (statistics.median(times[c][1:]) for c in ("none", "auto"))
            print(f"\nchat request, n={args.n}, {args.max_tokens} tokens, median of "
                  f"{args.num_requests} (after a warm-up)\n")
            print("| tool_choice | wall s | ratio |\n|---|---:|---:|")
            print(f"| none (not parsed) | {none:.3f} | 1.000x |")
            print(f"| auto (parsed: hermes + qwen3) | {auto:.3f} | {auto / none:.3f}x |")
        finally:
            server.stop()


def main() -> None:
    args = parse_args()
    streaming_rows(args.lengths)
    if not args.skip_server:
        chat_overhead_rows(args)


if __name__ == "__main__":
    main()
