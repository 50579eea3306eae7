"""TRL's `VLLMClient`, unchanged, against `serve --http-port` (the shared server): generate
from token ids with `logprobs=0`, chat with tools, and the teacher logprobs of
`get_sequence_logprobs`; each equal to the gRPC path (`EngineClient`) and to the Hugging Face
model (greedy tokens; logprobs within 1e-5, fp32).

VLLMClient's constructor insists on vLLM being importable (for NCCL weight syncing, which goes
over gRPC here): only that availability check is patched."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from transformers.utils import get_json_schema
from trl.generation import vllm_client

from tests.e2e.http_helpers import CHAT_TEMPLATE, MESSAGES, get_weather, grpc_params
from tests.integration.hf_oracle import hf_greedy_batch, hf_logprobs

PROMPTS = [[3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90], [101, 7]]
NUM_TOKENS = 8
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def trl_client(server):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
        yield vllm_client.VLLMClient(base_url=server.http_url, connection_timeout=30)


def test_generate_from_token_ids_equals_grpc_and_hf(trl_client, client, llama_dir):
    result = trl_client.generate(PROMPTS, n=1, temperature=0.0, max_tokens=NUM_TOKENS,
                                 logprobs=0, generation_kwargs={"ignore_eos": True})
    expected = client.generate(PROMPTS, grpc_params(temperature=0.0, max_tokens=NUM_TOKENS))
    assert result["prompt_ids"] == PROMPTS
    assert result["completion_ids"] == [o.outputs[0].token_ids for o in expected]
    assert result["completion_ids"] == hf_greedy_batch(str(llama_dir), PROMPTS, NUM_TOKENS)
    for prompt, ids, logprobs, lp_ids, output in zip(PROMPTS, result["completion_ids"],
                                                     result["logprobs"],
                                                     result["logprob_token_ids"], expected):
        assert [lp[0] for lp in logprobs] == output.outputs[0].logprobs  # bit-exact
        assert [t[0] for t in lp_ids] == ids  # logprobs=0: the sampled token alone
        hf = hf_logprobs(str(llama_dir), prompt, ids)
        assert [lp[0] for lp in logprobs] == pytest.approx(hf.tolist(), abs=LOGPROB_ATOL)


def test_seeded_groups_equal_the_grpc_path(trl_client, client):
    result = trl_client.generate(PROMPTS, n=4, temperature=1.0, top_k=0, max_tokens=NUM_TOKENS,
                                 logprobs=2, generation_kwargs={"seed": 3, "ignore_eos": True})
    expected = client.generate(PROMPTS, grpc_params(n=4, seed=3, max_tokens=NUM_TOKENS,
                                                    logprobs=2))
    completions = [c for o in expected for c in o.outputs]  # prompt-major, as TRL reads them
    assert result["completion_ids"] == [c.token_ids for c in completions]
    for logprobs, lp_ids, completion in zip(result["logprobs"], result["logprob_token_ids"],
                                            completions):
        for position, ids, top in zip(logprobs, lp_ids, completion.top_logprobs):
            entries = dict(zip(top.token_ids, top.logprobs))  # sampled first, then the top 2
            assert dict(zip(ids, position)) == entries


def test_chat_with_tools_equals_grpc_and_hf(trl_client, client, llama_dir):
    trl_client.reset_prefix_cache()  # both paths compute the prompts afresh: bit-exact logprobs
    result = trl_client.chat([MESSAGES, MESSAGES[1:]], temperature=0.0, max_tokens=NUM_TOKENS,
                             tools=[get_weather], chat_template=CHAT_TEMPLATE,
                             generation_kwargs={"ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    rendered = [tokenizer.apply_chat_template(
        conversation, tools=[get_json_schema(get_weather)], chat_template=CHAT_TEMPLATE,
        add_generation_prompt=True, return_dict=False) for conversation in (MESSAGES,
                                                                           MESSAGES[1:])]
    assert result["prompt_ids"] == rendered
    client.reset_prefix_cache()
    expected = client.generate(rendered, grpc_params(temperature=0.0, max_tokens=NUM_TOKENS))
    assert result["completion_ids"] == [o.outputs[0].token_ids for o in expected]
    assert result["completion_ids"] == hf_greedy_batch(str(llama_dir), rendered, NUM_TOKENS)
    for logprobs, output in zip(result["logprobs"], expected):
        assert [lp[0] for lp in logprobs] == output.outputs[0].logprobs


def test_sequence_logprobs_equal_grpc_score_and_hf(trl_client, client, llama_dir):
    sequences = [PROMPTS[0] + [44, 45, 46, 47], PROMPTS[1] + [9, 8, 7]]
    prompt_lengths = [len(PROMPTS[0]), len(PROMPTS[1])]
    result = trl_client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=3)
    scored = client.score(sequences, prompt_lengths, logprobs=3)
    for i, (sequence, prompt_len) in enumerate(zip(sequences, prompt_lengths)):
        actual = [lp[0] for lp in result["actual_logprobs"][i]]
        assert actual == scored[i].logprobs  # bit-exact with the gRPC Score RPC
        hf = hf_logprobs(str(llama_dir), sequence[:prompt_len], sequence[prompt_len:])
        assert actual == pytest.approx(hf.tolist(), abs=LOGPROB_ATOL)
        for top, ids, entry in zip(result["logprobs"][i], result["logprob_token_ids"][i],
                                   scored[i].top_logprobs):
            assert ids == entry.token_ids[1:]  # the top 3, most likely first
            assert top == entry.logprobs[1:]


def test_control_endpoints_trl_reads(trl_client):
    config = trl_client.get_server_info()
    assert config["model_config"]["dtype"] == "float32"
    assert config["model_config"]["max_model_len"] == 256
    assert config["weight_transfer_config"] is None  # weights go over gRPC
    assert trl_client.get_world_size() == 1
    trl_client.reset_prefix_cache()
    with pytest.raises(Exception, match="501.*trainer_bridge.EngineClient"):
        trl_client._start_weight_update()


def test_server_distillation_trains_with_this_server_as_its_teacher(server, tmp_path, llama_dir,
                                                                     other_model_dirs):
    """TRL's ServerDistillationTrainer (its teacher behind `get_sequence_logprobs`) runs two
    steps on the CPU, its student on-policy through transformers."""
    import requests
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.server_distillation import (
        ServerDistillationConfig,
        ServerDistillationTrainer,
    )

    def requests_total() -> float:
        metrics = requests.get(f"{server.http_url}/metrics", timeout=10).text
        line = next(m for m in metrics.splitlines() if m.startswith("rollout_engine_requests_t"))
        return float(line.rsplit(" ", 1)[1])

    torch.manual_seed(0)
    args = ServerDistillationConfig(
        output_dir=str(tmp_path / "trainer"), teacher_model_server_url=server.http_url,
        per_device_train_batch_size=4, max_completion_length=8, max_steps=2, beta=0.0,
        loss_top_k=2, learning_rate=1e-3, logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0)
    before = requests_total()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
        trainer = ServerDistillationTrainer(
            model=AutoModelForCausalLM.from_pretrained(other_model_dirs[1], dtype=torch.float32),
            args=args, processing_class=AutoTokenizer.from_pretrained(llama_dir),
            train_dataset=Dataset.from_dict({"prompt": ["the old man walked to", "a new idea",
                                                        "once upon a time", "children learn"]}))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < loss < float("inf") for loss in losses), losses
    assert requests_total() - before >= 8  # 2 steps x 4 sequences scored by the teacher
