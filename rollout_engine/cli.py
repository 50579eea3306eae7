"""The `rollout-engine` command line: one function pair (parser, runner) per subcommand."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from rollout_engine.parsing import REASONING_NAMES, TOOL_NAMES
from rollout_engine.protocol import DEFAULT_MAX_MESSAGE_BYTES, EngineError

Runner = Callable[[argparse.Namespace], int]


def _structured_outputs_config(text: str) -> dict:
    """vLLM's --structured-outputs-config, of which `enable_in_reasoning` is taken (the
    backend is always llguidance)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(config, dict) or set(config) - {"enable_in_reasoning", "backend"}:
        raise argparse.ArgumentTypeError('takes {"enable_in_reasoning": true|false}')
    if config.get("backend", "guidance") not in ("auto", "guidance", "llguidance"):
        raise argparse.ArgumentTypeError("the structured-outputs backend here is llguidance")
    return config


def _speculative_config(text: str) -> dict:
    """vLLM's --speculative-config: a JSON object of `SpeculativeConfig` fields (checked when
    the engine config is built)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError('takes a JSON object, e.g. {"method": "suffix", '
                                         '"num_speculative_tokens": 4}')
    return config


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
    for add_subcommand in (_add_make_tiny_model, _add_generate, _add_serve):
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


# serve ----------------------------------------------------------------------------------

AUTH_TOKEN_ENV = "ROLLOUT_ENGINE_AUTH_TOKEN"
API_KEY_ENV = "ROLLOUT_ENGINE_API_KEY"


def _parse_bytes(text: str) -> int:
    """"1073741824", "512MiB", "2GiB", "64M" -> bytes (binary units)."""
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = units.get(value[-1:], 1)
    number = value[:-1] if scale > 1 else value
    try:
        num_bytes = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 512MiB)") from None
    if num_bytes <= 0:
        raise argparse.ArgumentTypeError(f"byte count must be positive, got {text!r}")
    return num_bytes


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = _add_command(
        subparsers,
        "serve",
        _run_serve,
        "Serve a model over gRPC (RolloutEngine service, health, reflection), and over "
        "HTTP with vllm serve's API (--http-port)",
        "Binds 127.0.0.1 by default and prints `rollout-engine serving MODEL on HOST:PORT` to "
        "stderr once ready (after `rollout-engine HTTP (vllm serve API) on http://HOST:PORT` "
        "with --http-port). SIGTERM drains in-flight calls for --shutdown-grace-s, then exits 0.",
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    net.add_argument("--port", type=int, default=50051,
                     help="TCP port; 0 picks a free one (default: %(default)s)")
    net.add_argument("--auth-token", default=os.environ.get(AUTH_TOKEN_ENV),
                     help="require `authorization: Bearer TOKEN` on every call but health "
                     f"checks (default: ${AUTH_TOKEN_ENV})")
    net.add_argument("--allow-insecure-remote", action="store_true",
                     help="allow a non-loopback --host without --auth-token")
    net.add_argument("--max-inflight-requests", type=int, default=4096,
                     help="samples (prompts x n) in flight at once; more get "
                     "RESOURCE_EXHAUSTED (default: %(default)s)")
    net.add_argument("--max-n", type=int, default=1024,
                     help="largest n (samples per prompt) a call may ask for; more get "
                     "INVALID_ARGUMENT (default: %(default)s)")
    net.add_argument("--max-message-bytes", type=_parse_bytes, default=DEFAULT_MAX_MESSAGE_BYTES,
                     help="largest gRPC message either way (default: 64MiB)")
    net.add_argument("--shutdown-grace-s", type=float, default=10.0,
                     help="on SIGTERM, seconds in-flight calls get before they are aborted "
                     "(default: %(default)s)")
    net.add_argument("--engine-stall-s", type=float, default=60.0,
                     help="health reports NOT_SERVING while one engine step or command has run "
                     "this long (default: %(default)s)")
    http = parser.add_argument_group("HTTP (vllm serve's API: OpenAI completions and chat, "
                                     "tokenize, metrics, RL control endpoints)")
    http.add_argument("--http-port", type=int,
                      help="also serve HTTP on this port of --host; 0 picks a free one "
                      "(default: off)")
    http.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                      help="require `Authorization: Bearer KEY` on every HTTP request but "
                      f"/health; needed for a non-loopback --host (default: ${API_KEY_ENV})")
    http.add_argument("--enable-control-endpoints", action="store_true",
                      help="serve /sleep, /wake_up, /pause, /server_info... on a non-loopback "
                      "--host too (vLLM's dev mode; always on for loopback)")
    http.add_argument("--served-model-name", nargs="+", default=(),
                      help="the names requests may give as `model`; the first is reported "
                      "(default: the --model path)")
    http.add_argument("--trust-request-chat-template", action="store_true",
                      help="render the chat_template a request sends (it runs in the server); "
                      "without it such requests get 400")
    http.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                      help="serve GET /tokenizer_info (the tokenizer's configuration and chat "
                      "template)")
    agents = parser.add_argument_group("agents (chat tool calls and reasoning, vLLM's flags)")
    agents.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='parse the tool calls of chat requests with tool_choice "auto"')
    agents.add_argument("--tool-call-parser", choices=sorted(TOOL_NAMES),
                        help="the format of the model's tool calls; 'required' and named "
                        "tool choices are generated in it (hermes, llama3_json, qwen3_xml)")
    agents.add_argument("--reasoning-parser", choices=sorted(REASONING_NAMES),
                        help="split <think> reasoning from the answer (message.reasoning)")
    agents.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='render no tools into the prompt when tool_choice is "none"')
    agents.add_argument("--structured-outputs-config", type=_structured_outputs_config,
                        default={}, help='JSON; {"enable_in_reasoning": true} constrains from '
                        "the first token even with a reasoning parser (default: once the "
                        "reasoning has ended)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                        default="auto", help="(default: %(default)s)")
    engine.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: %(default)s)")
    engine.add_argument("--seed", type=int, default=0,
                        help="seed of the engine's random stream (default: %(default)s)")
    engine.add_argument("--cpu-threads", type=int,
                        help="CPU: OpenMP threads of the forward (default: the cores other "
                        "processes leave free, re-checked as it runs)")
    engine.add_argument("--no-cpu-packed-weights", dest="cpu_packed_weights",
                        action="store_false", default=None,
                        help="CPU: plain F.linear instead of oneDNN on packed weight copies "
                        "(saves their memory; default: packed)")
    engine.add_argument("--model-impl", choices=["auto", "native", "transformers"],
                        help="modeling code: our native decoder, Hugging Face's transformers "
                        "with our paged attention, or auto (native where it exists; default)")
    engine.add_argument("--batch-invariant", action="store_true", default=None,
                        help="kernels (CPU or CUDA) whose bits do not depend on the batch, so "
                        "logprobs equal a trainer's under rollout_engine.batch_invariant "
                        "(default: off)")
    engine.add_argument("--cuda-graphs", action="store_true", default=None,
                        help="replay decode steps from CUDA graphs (default: off)")
    engine.add_argument("--kv-cache-bytes", type=_parse_bytes,
                        help="bytes of the KV pool, e.g. 2GiB (default: the engine's)")
    engine.add_argument("--num-blocks", type=int, help="KV blocks (overrides --kv-cache-bytes)")
    engine.add_argument("--gpu-memory-utilization", type=float,
                        help="CUDA: fraction of the device the engine may use in all, when "
                        "--kv-cache-bytes is not given (default: the engine's, 0.5)")
    engine.add_argument("--block-size", type=int, help="tokens per KV block")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="turn off prefix caching")
    engine.add_argument("--max-kv-keep-alive-s", type=float,
                        help="the longest a finished turn's KV is held for its conversation's "
                        "next turn when the request asks (kv_keep_alive_s); 0: never "
                        "(default: 60)")
    engine.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    engine.add_argument("--max-num-seqs", type=int, help="most running requests at once")
    engine.add_argument("--max-model-len", type=int,
                        help="prompt + output cap (default: the model's)")
    engine.add_argument("--num-speculative-tokens", type=int,
                        help="n-gram draft tokens per step; 0 turns drafting off")
    engine.add_argument("--enable-return-routed-experts", action="store_true", default=None,
                        help="MoE models: return the experts each token was routed to "
                        "(routing replay in the trainer)")
    engine.add_argument("--return-sampling-mask", action="store_true", default=None,
                        help="every request returns its sampling masks (the ids top-k, top-p "
                        "or min-p kept per token)")
    engine.add_argument("--speculative-config", type=_speculative_config,
                        help='JSON, vLLM\'s: {"method": "ngram" | "suffix", '
                        '"num_speculative_tokens": k, ...} (suffix: drafts from earlier '
                        "completions of the same prompt too)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="schedule and prepare the next step while the current one "
                        "computes (default: the engine's)")
    parallel = parser.add_argument_group("tensor parallelism")
    parallel.add_argument("--tensor-parallel-size", type=int,
                          help="split the model over this many ranks, one process each "
                          "(cuda:0..N-1 on GPUs, the cores shared on CPU; default: 1)")
    parallel.add_argument("--distributed-timeout-s", type=float,
                          help="a rank that has not finished a collective or command by then "
                          "fails the step, named in the error (default: 60)")
    lora = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", default=None,
                      help="serve LoRA adapters unmerged beside the base model")
    lora.add_argument("--max-loras", type=int, help="adapters a step runs at once (default: 1)")
    lora.add_argument("--max-lora-rank", type=int, help="largest adapter rank (default: 16)")
    lora.add_argument("--max-cpu-loras", type=int,
                      help="adapters read from a path kept in host memory (default: max-loras)")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=(),
                      metavar="NAME=PATH",
                      help="adapters to load at start: name=path, or JSON {\"name\", \"path\"}; "
                      "requests name them as their model")
    kv = parser.add_argument_group("prefill-decode disaggregation")
    kv.add_argument("--kv-role", choices=["prefill", "decode", "both"],
                    help="save prompts' KV for a decode engine (prefill), load it (decode), or "
                    "either (both); unset: no KV transfers")
    kv.add_argument("--kv-peer", metavar="ADDR",
                    help="decode side: the prefill server to pull KV from over gRPC (default: "
                    "the address each handle names)")
    kv.add_argument("--kv-transport", choices=["shm", "grpc", "cuda_ipc"],
                    help="prefill side: how the KV is handed over (default: shm, one host)")
    kv.add_argument("--kv-transfer-timeout-s", type=float,
                    help="decode side: give a transfer up after this long and compute the "
                    "prompt here (default: 30)")
    kv.add_argument("--kv-handle-ttl-s", type=float,
                    help="prefill side: drop saved KV nobody pulled after this long "
                    "(default: 120)")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="(default: %(default)s)")


_SERVE_ENGINE_OPTIONS = (
    "dtype", "device", "seed", "cpu_threads", "cpu_packed_weights", "model_impl", "cuda_graphs",
    "batch_invariant", "kv_cache_bytes", "num_blocks", "block_size", "max_kv_keep_alive_s",
    "gpu_memory_utilization",
    "max_num_batched_tokens", "max_num_seqs", "max_model_len", "num_speculative_tokens",
    "async_scheduling", "kv_role", "kv_peer", "kv_transport", "kv_transfer_timeout_s",
    "kv_handle_ttl_s", "tensor_parallel_size", "distributed_timeout_s", "enable_lora",
    "max_loras", "max_lora_rank", "max_cpu_loras", "speculative_config",
    "enable_return_routed_experts", "return_sampling_mask",
)


def _lora_module(text: str) -> tuple[str, str]:
    """`--lora-modules` entry: name=path or vLLM's JSON form."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
            return str(entry["name"]), str(entry["path"])
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"bad JSON LoRA module {text!r}: {exc}") from exc
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _run_serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from rollout_engine.config import EngineConfig, ServerConfig
    from rollout_engine.server.async_engine import AsyncEngine
    from rollout_engine.server.serve import run_server

    options = {k: getattr(args, k) for k in _SERVE_ENGINE_OPTIONS if getattr(args, k) is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    try:
        server_config = ServerConfig(
            host=args.host,
            port=args.port,
            max_inflight_requests=args.max_inflight_requests,
            max_n=args.max_n,
            auth_token=args.auth_token or None,
            allow_insecure_remote=args.allow_insecure_remote,
            max_message_bytes=args.max_message_bytes,
            shutdown_grace_s=args.shutdown_grace_s,
            engine_stall_s=args.engine_stall_s,
            http_port=args.http_port,
            # ROLLOUT_ENGINE_API_KEY alone asks for no HTTP server.
            api_key=(args.api_key or None) if args.http_port is not None else None,
            enable_control_endpoints=args.enable_control_endpoints,
            served_model_names=tuple(args.served_model_name),
            trust_request_chat_template=args.trust_request_chat_template,
            enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            structured_outputs_in_reasoning=args.structured_outputs_config.get(
                "enable_in_reasoning", False),
        )
        engine_config = EngineConfig.from_kwargs(args.model, **options)
        if args.lora_modules and not engine_config.lora_config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
    except ValueError as exc:
        print(f"rollout-engine serve: error: {exc}", file=sys.stderr)
        return 2
    llm_engine = _build_engine_off_this_thread(engine_config)
    try:
        for name, path in args.lora_modules:
            llm_engine.loras.add_named(name, path)
    except ValueError as exc:
        llm_engine.shutdown()
        print(f"rollout-engine serve: error: {exc}", file=sys.stderr)
        return 2
    engine = AsyncEngine(llm_engine, server_config, model_name=args.model)
    return run_server(engine, server_config)


def _build_engine_off_this_thread(engine_config):
    """The engine, built so that this thread (gRPC's event loop) holds no OpenMP workers.

    The server runs every step on its engine thread. With more OpenMP workers in the process
    than cores, libgomp's workers sleep and wake at every barrier instead of spinning: a
    served rollout on the CPU was 30% slower than the same engine stepped from the thread
    that had loaded it. So the engine is loaded on a thread that then exits (its workers go
    with it), and this thread does its own tensor work with one thread.
    """
    import concurrent.futures

    import torch

    from rollout_engine.engine.llm_engine import LLMEngine

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-build") as builder:
        engine = builder.submit(LLMEngine, engine_config).result()
    torch.set_num_threads(1)
    return engine


if __name__ == "__main__":
    sys.exit(main())
