"""The `rollout-engine` command line: one function pair (parser, runner) per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rollout_engine.errors import EngineError

Runner = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), run the subcommand, return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.runner is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.runner(args)
    except (EngineError, OSError) as exc:
        print(f"rollout-engine {args.command}: error: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-engine",
        description="A rollout engine for RL post-training: offline generation, "
        "a gRPC server, and tools to make test models.",
    )
    parser.set_defaults(runner=None, command=None)
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_subcommand in (_add_make_tiny_model, _add_generate):
        add_subcommand(subparsers)
    return parser


def _add_command(
    subparsers: argparse._SubParsersAction, name: str, runner: Runner, summary: str, details: str
) -> argparse.ArgumentParser:
    """Register a subcommand whose arguments the caller then adds."""
    parser = subparsers.add_parser(
        name,
        help=summary,
        description=f"{summary}. {details}",
    )
    parser.set_defaults(runner=runner, command=name)
    return parser


# make-tiny-model ------------------------------------------------------------------------


def _add_make_tiny_model(subparsers: argparse._SubParsersAction) -> None:
    from rollout_engine.tiny_model import ARCHITECTURES, SIZES

    parser = _add_command(
        subparsers,
        "make-tiny-model",
        _run_make_tiny_model,
        "Write a Hugging Face model directory with random weights",
        "The directory holds config.json, model.safetensors, a byte-level BPE tokenizer and "
        "generation_config.json, and loads with transformers' from_pretrained. The same "
        "arguments always write identical files.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="directory to write")
    parser.add_argument(
        "--arch", choices=ARCHITECTURES, default="llama", help="model family (default: %(default)s)"
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="size preset (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)"
    )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=1024,
        help="longest supported sequence (default: %(default)s)",
    )
    parser.add_argument(
        "--llama3-rope-scaling",
        action="store_true",
        help="use Llama-3 style RoPE scaling (factor 8, original length 256)",
    )


def _run_make_tiny_model(args: argparse.Namespace) -> int:
    from rollout_engine.tiny_model import LLAMA3_ROPE_SCALING, build_tiny_model

    output_dir = build_tiny_model(
        args.output_dir,
        architecture=args.arch,
        size=args.size,
        seed=args.seed,
        max_position_embeddings=args.max_position_embeddings,
        rope_scaling=dict(LLAMA3_ROPE_SCALING) if args.llama3_rope_scaling else None,
    )
    print(output_dir)
    return 0


# generate -------------------------------------------------------------------------------


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_command(
        subparsers,
        "generate",
        _run_generate,
        "Generate completions offline, in this process",
        "Loads the model with the engine's offline LLM class and prints each completion.",
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument(
        "--prompt", required=True, action="append", help="prompt text; repeat for a batch"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per completion (default: %(default)s)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 means greedy (default: %(default)s)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)"
    )
    parser.add_argument(
        "-n", type=int, default=1, help="completions per prompt (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling stream (default: the engine's)"
    )
    parser.add_argument("--show-token-ids", action="store_true", help="also print token ids")


def _run_generate(args: argparse.Namespace) -> int:
    from rollout_engine import LLM, SamplingParams

    sampling_params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    llm = LLM(args.model)
    request_outputs = llm.generate(args.prompt, sampling_params)
    for prompt, request_output in zip(args.prompt, request_outputs, strict=True):
        for completion in request_output.outputs:
            print(
                f"[prompt {prompt!r}, sample {completion.index}, "
                f"{completion.finish_reason}] {completion.text!r}"
            )
            if args.show_token_ids:
                print(f"  token_ids: {list(completion.token_ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
