"""Run one GRPO-shaped generation with vLLM's CPU build and print its timing as JSON.

Started by `run_vllm` (benchmarks/common.py) with the interpreter of `.peers/vllm` (`make
peers`), as a plain script: it imports vLLM only, never this project, whose packages that venv
lacks. The request comes as a JSON file:
{"model": dir, "prompts": [[ids]], "n": 8, "max_tokens": 128, "max_model_len": 2048,
 "max_num_batched_tokens": 2048, "threads": 2, "repeats": 1, "dtype": "float32",
 "enforce_eager": false} (false: vLLM's default, its graphs through torch.compile). The answer,
on the last line of stdout: {"elapsed_s": [per repeat], "num_tokens": N, "version": "..."}.
With "greedy": true the job is one greedy sample per prompt instead (n ignored), and the answer
also holds "token_ids", one list per prompt. With "lora_paths" (PEFT adapter directories), LoRA
is enabled (max_loras: their number, "max_lora_rank") and prompt i runs under adapter
i % their number; "moe_lora_3d": true says that they adapt a MoE's fused 3-d expert weights
(PEFT's `target_parameters`: vLLM's enable_mixed_moe_lora_format and is_3d_lora_weight).

vLLM's CPU build runs unseeded here (a per-request seed crashes it on the CPU) and in one
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set before vLLM is imported).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 4)))
    threads = job.get("threads")
    if threads:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    lora_paths = job.get("lora_paths") or []
    lora_options = {}
    if lora_paths:
        lora_options = {"enable_lora": True, "max_loras": len(lora_paths),
                        "max_lora_rank": job.get("max_lora_rank", 16)}
        if job.get("moe_lora_3d"):
            lora_options["enable_mixed_moe_lora_format"] = True
    llm = LLM(
        model=job["model"], dtype=job.get("dtype", "float32"),
        enforce_eager=job.get("enforce_eager", False), max_model_len=job["max_model_len"],
        max_num_batched_tokens=job["max_num_batched_tokens"], enable_prefix_caching=True,
        max_num_seqs=job.get("max_num_seqs", 256), skip_tokenizer_init=False, **lora_options,
    )
    greedy = job.get("greedy", False)
    params = SamplingParams(n=1 if greedy else job["n"], temperature=0.0 if greedy else 1.0,
                            top_p=1.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    loras = None
    if lora_paths:
        from vllm.lora.request import LoRARequest

        adapters = [LoRARequest(f"adapter-{i}", i + 1, path,
                                is_3d_lora_weight=bool(job.get("moe_lora_3d")))
                    for i, path in enumerate(lora_paths)]
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, detokenize=False),
                 lora_request=None if loras is None else loras[:1])  # warm-up
    elapsed_s, num_tokens = [], 0
    for _ in range(job.get("repeats", 1)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed_s.append(time.perf_counter() - start)
        num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    answer = {"elapsed_s": elapsed_s, "num_tokens": num_tokens, "version": vllm.__version__}
    if greedy:
        answer["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
