"""TRL integration v2 against real engine servers: LoRA weights that reach the engine merged,
a weight sync that streams (bounded extra memory), one push per generation step across
turns, and every GRPOConfig generation setting honoured or refused at construction."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl
from peft import LoraConfig
from trl import GRPOConfig

from tests.e2e.test_trl_backend import (
    GREEDY_PROMPTS,
    NUM_GREEDY_TOKENS,
    engine_greedy,
    hf_greedy,
    make_trainer,
)
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl import _REFUSED_UNLESS_DEFAULT, check_generation_settings

REPO_ROOT = Path(__file__).resolve().parents[2]
LORA = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "gate_proj"],
                  init_lora_weights=False)  # random B: the merged weights differ from the base


@pytest.fixture(scope="module")
def engine(tmp_path_factory, llama_dir):
    """One server for the module: every test attaches afresh, and each attach pushes the
    trainer's weights before it generates, whatever state the last test left."""
    options = {"kv_cache_bytes": "8MiB", "max_model_len": 48}
    log_path = tmp_path_factory.mktemp("engine") / "server.log"
    with EngineServer(llama_dir, engine_options=options, log_path=log_path) as server:
        yield server


# ------------------------------------------------------------------------------------ LoRA
def test_lora_sync_sends_the_merged_weights_and_leaves_the_trainer_unmerged(
    engine, llama_dir, tmp_path
):
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, peft_config=LORA)
    model = trainer.model
    base_layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base_before = base_layer.base_layer.weight.detach().clone()

    trainer.sync_engine_weights()

    merged = copy.deepcopy(model).merge_and_unload()
    expected = hf_greedy(merged, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
    with model.disable_adapter():
        base_only = hf_greedy(model, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
    assert expected != base_only, "the adapter should change the greedy continuations"
    assert engine_greedy(client) == expected  # the engine serves base + adapter
    assert not base_layer.merged  # the trainer trains the adapter on the unmerged base
    # Unmerging subtracts what merging added: equal up to fp32 rounding, as in TRL itself.
    assert torch.allclose(base_layer.base_layer.weight, base_before, rtol=0, atol=1e-6)
    client.close()


# ------------------------------------------------------------------------- memory of a sync
PROBE = """
import gc, json, sys
import torch
from transformers import AutoModelForCausalLM
from trainer_bridge import EngineClient
from trainer_bridge.colocate import Colocation, StreamedWeights, release_trainer_cache
from trainer_bridge.trainer_weights import iter_policy_weights

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

model_dir, address, transport = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
for p in model.parameters():  # page in weights a loader may have left memory-mapped
    p.data = p.data.clone()
colocation = Colocation(EngineClient(address, timeout=120), sleep_level=None,
                        transport=transport, weight_dtype="engine")
weights = StreamedWeights(lambda: iter_policy_weights(model))
gc.collect(); release_trainer_cache()
baseline = rss("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from the current RSS
colocation.sync_weights(weights)
print(json.dumps({"model_bytes": sum(p.nbytes for p in model.parameters()),
                  "extra_bytes": rss("VmHWM:") - baseline}))
"""


@pytest.fixture(scope="module")
def large_model_dir(tmp_path_factory) -> Path:
    """A Llama of about 140 MB in fp32 (the probe casts it to the engine's bf16)."""
    from rollout_engine.tiny_model import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("large") / "model", "llama", "tiny", vocab_size=8192,
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=256,
    )


@pytest.mark.parametrize("transport", ["shm", pytest.param("stream", marks=pytest.mark.slow)])
def test_sync_holds_at_most_two_buckets_beyond_the_model(large_model_dir, tmp_path, transport):
    bucket_bytes = 16 * 2**20  # the client's default bucket
    options = {"kv_cache_bytes": "4MiB", "dtype": "bfloat16"}
    with EngineServer(large_model_dir, engine_options=options,
                      log_path=tmp_path / "server.log") as server:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [sys.executable, "-c", PROBE, str(large_model_dir), server.address, transport],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        with EngineClient(server.address) as client:
            assert client.info().weight_version == 1
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["model_bytes"] >= 100 * 2**20
    # Allowed beyond the model: two buckets, the tensor being cast (the 8 MiB bf16 embedding)
    # and 12 MiB for the interpreter and gRPC. A cast copy of the model alone is 64 MiB.
    # Measured here: shm 44.8 MiB, stream 45.3 MiB.
    largest_cast = 8192 * 512 * 2
    assert measured["extra_bytes"] <= 2 * bucket_bytes + largest_cast + 12 * 2**20, measured


# ----------------------------------------------------------------------------- multi-turn
def two_turn_rollout(prompts: list[str], trainer) -> dict:
    """A tool-using rollout: the model answers, a tool's output is appended, the model
    answers again; tool tokens are masked out of the loss (env_mask)."""
    backend, tokenizer = trainer.vllm_generation, trainer.processing_class
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    _, first, first_lps, _ = backend.generate(prompts=prompt_ids, images=None,
                                              num_generations=trainer.num_generations)
    trainer.turn_log.append((backend.client.memory_state().is_sleeping,
                             backend.colocation.num_weight_pushes))
    tool_output = [17, 18, 19]  # the tool's answer, as tokens
    follow_ups = [p + c + tool_output for p, c in zip(prompt_ids, first, strict=True)]
    _, second, second_lps, _ = backend.generate(prompts=follow_ups, images=None,
                                                num_generations=1)
    trainer.turn_log.append((backend.client.memory_state().is_sleeping,
                             backend.colocation.num_weight_pushes))
    completions, logprobs, env_mask = [], [], []
    for c1, l1, c2, l2 in zip(first, first_lps, second, second_lps, strict=True):
        completions.append(c1 + tool_output + c2)
        logprobs.append([lp[0] for lp in l1] + [0.0] * len(tool_output) + [lp[0] for lp in l2])
        env_mask.append([1] * len(c1) + [0] * len(tool_output) + [1] * len(c2))
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs,
            "env_mask": env_mask}


def test_two_turn_rollouts_push_weights_once_per_step_and_stay_awake(engine, llama_dir, tmp_path):
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, max_completion_length=6,
                           rollout_func=two_turn_rollout)
    trainer.turn_log = []
    version_before = client.info().weight_version
    trainer.train()
    # Per step: pushed before the first turn, awake for the second, no push in between.
    assert trainer.turn_log == [(False, 1), (False, 1), (False, 2), (False, 2)]
    assert trainer.engine_generation.colocation.num_weight_pushes == 2
    assert client.info().weight_version == version_before + 2
    assert client.memory_state().is_sleeping  # asleep once the trainer computed again
    assert [h for h in trainer.state.log_history if "reward" in h]
    client.close()


# ------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("name", sorted(_REFUSED_UNLESS_DEFAULT))
def test_generation_settings_the_engine_would_ignore_are_refused(name, tmp_path):
    values = {"vllm_tensor_parallel_size": 2,
              "vllm_max_model_length": 128, "vllm_gpu_memory_utilization": 0.5,
              "vllm_model_impl": "transformers", "use_transformers_continuous_batching": True,
              "use_transformers_paged": True, "cache_implementation": "static"}
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    check_generation_settings(args)  # the defaults pass
    setattr(args, name, values[name])
    with pytest.raises(ValueError, match=name):
        check_generation_settings(args)


def test_unknown_generation_kwargs_and_vespo_without_token_modes_are_refused(tmp_path):
    for kwargs, words in [({"best_of": 2}, "best_of"), ({"n": 4}, "num_generations"),
                          ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
                          ({"logprobs_mode": "raw_logprobs"}, "importance-sampling"),
                          ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop")]:
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                          generation_kwargs=kwargs)
        with pytest.raises(ValueError, match=words):
            check_generation_settings(args)
    supported = {"structured_outputs": {"regex": "a"}, "stop": ["</a>"], "logprobs": 2,
                 "min_tokens": 4, "presence_penalty": 0.5, "logit_bias": {3: 1.0}}
    check_generation_settings(GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                         max_completion_length=8, generation_kwargs=supported))
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_type="vespo",
                      vllm_importance_sampling_mode="sequence_mask")
    with pytest.raises(ValueError, match="VESPO"):
        check_generation_settings(args)


def test_refused_setting_fails_at_construction(engine, llama_dir, tmp_path):
    with EngineClient(engine.address) as client, pytest.raises(ValueError, match="parallel"):
        make_trainer(llama_dir, tmp_path, client, vllm_tensor_parallel_size=2)


def test_trl_structured_outputs_regex_reaches_the_engine(engine, llama_dir, tmp_path):
    from transformers import AutoTokenizer

    regex = r"(yes|no) [0-9]{1,2}\."
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, vllm_structured_outputs_regex=regex,
                           max_completion_length=24)
    backend = trainer.engine_generation
    backend.sync_weights()
    _, completions, _, _ = backend.generate([[3, 14, 15]] * 2, None, num_generations=2)
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
    assert all(re.fullmatch(regex, t) for t in texts), texts
    client.close()


def test_max_completion_length_none_generates_to_the_model_length(engine, llama_dir, tmp_path):
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client, max_completion_length=None,
                           generation_kwargs={"ignore_eos": True})
    backend = trainer.engine_generation
    backend.sync_weights()
    prompts = [[3, 14, 15]] * 2 + [[3, 14, 15, 92, 65]] * 2
    _, completions, _, _ = backend.generate(prompts, None, num_generations=2)
    assert [len(c) for c in completions] == [45, 45, 43, 43]  # max_model_len 48
    client.close()


def test_dtype_mismatch_is_refused_at_construction_unless_cast_is_asked(llama_dir, tmp_path):
    with EngineServer(llama_dir, engine_options={"kv_cache_bytes": "8MiB", "dtype": "bfloat16"},
                      log_path=tmp_path / "server.log") as server:
        client = EngineClient(server.address, timeout=60)
        with pytest.raises(ValueError, match="weight_dtype='engine'"):
            make_trainer(llama_dir, tmp_path, client)
        trainer = make_trainer(llama_dir, tmp_path, client, weight_dtype="engine")
        assert trainer.sync_engine_weights() == 1
        client.close()


# ---------------------------------------------------------------------------- TRL version
def test_pinned_trl_minor_still_has_what_the_bridge_uses():
    """The bridge depends on TRL's documented trainer and, for sharded weights only, on its
    private gatherer; pyproject pins TRL's minor version, and this pins the private parts."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    assert trl.__version__.startswith("1.16.")
    assert callable(VLLMGeneration._iter_named_params)
    assert {"is_zero3", "is_fsdp", "gather_params"} <= set(dir(DistributedBackend))


@pytest.mark.slow
def test_lora_sync_with_accelerate_two_ranks(llama_dir, tmp_path):
    from tests.e2e.test_multi_trainer import free_port

    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu",
        "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(REPO_ROOT / "tests" / "e2e" / "scripts" / "lora_sync_ranks.py"), str(llama_dir),
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            check=False, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: served merged True, adapter matters True" in result.stdout, (
            result.stdout[-3000:]
        )


def test_the_engine_sleeps_at_the_trainers_next_forward_not_a_copys(engine, llama_dir, tmp_path):
    client = EngineClient(engine.address, timeout=60)
    trainer = make_trainer(llama_dir, tmp_path, client)
    backend = trainer.engine_generation
    backend.sync_weights()
    backend.generate([[3, 14, 15]] * 4, None, num_generations=4)
    reference = copy.deepcopy(trainer.model)  # e.g. a KL reference model
    with torch.no_grad():
        reference(torch.tensor([[3, 14, 15]]))
        assert not client.memory_state().is_sleeping  # a copy's forward is not the trainer's
        trainer.model(torch.tensor([[3, 14, 15]]))
    assert client.memory_state().is_sleeping  # the trainer computes: the engine steps aside
    client.close()
