"""TRL's AsyncGRPOTrainer with tools against `serve --http-port`: `EngineAsyncGRPOTrainer`'s
rollout worker sends every turn after the first as token in (`/v1/chat/completions/tokens`),
so TRL's reconciler finds each turn's prompt extending the tokens it holds: zero REALIGN, zero
FORK, one training row per conversation. The template renders a tool call with other spacing
than the model sampled it, so re-rendering the conversation (TRL's own worker) would drift:
the check can fail."""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoTokenizer
from trl.chat_template_utils import qwen3_template
from trl.experimental.async_grpo import AsyncGRPOConfig

from tests.e2e.server_process import start_server
from tests.e2e.trl_async_helpers import TappedQueue
from trainer_bridge.trl_async import EngineAsyncGRPOTrainer, EngineWeightTransfer

TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content if m.content is string else '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}{{ eos_token }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Every message closed by the end-of-turn token the model samples (EOS), Qwen's way."""
CALL = '<tool_call>\n{"name":"lookup","arguments":{"topic":"cats"}}\n</tool_call>'
"""Compact JSON: the template re-renders it with spaces."""
ANSWER = "Cats sleep."


def lookup(topic: str) -> str:
    """Look a topic up.

    Args:
        topic: the topic
    """
    return f"{topic} sleep a lot"


def turns_reward(completions: list, **kwargs) -> list[float]:
    """Module level: the worker's child process unpickles it by name."""
    return [float(len(messages)) for messages in completions]


@pytest.fixture(scope="module")
def async_server(tmp_path_factory, llama_dir):
    """A server of its own (the test changes its weights) that renders with the worker's
    chat template."""
    process = start_server(tmp_path_factory, llama_dir, "--http-port", "0",
                           "--max-model-len=1024", "--trust-request-chat-template")
    yield process
    assert process.stop() == 0, process.log()[-3000:]


def build_trainer(server, model_dir, output_dir, tokenizer,
                  request_extras: dict | None = None) -> EngineAsyncGRPOTrainer:
    """One step of 4 conversations of up to 3 turns, each answer a tool call or a plain one."""
    args = AsyncGRPOConfig(
        output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=64, max_tool_calling_iterations=2,
        token_budget=0, max_inflight_tasks=8, learning_rate=1e-3,
        vllm_server_base_url=server.http_url, report_to="none", save_strategy="no",
        logging_steps=1, bf16=False, gradient_checkpointing=False)
    return EngineAsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=turns_reward, args=args, tools=[lookup],
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "cats?"}]]}),
        processing_class=tokenizer, weight_transfer=EngineWeightTransfer(server.address),
        request_extras={"structured_outputs": {"choice": [CALL, ANSWER]},
                        **(request_extras or {})})


def test_async_grpo_tool_turns_are_all_clean(async_server, llama_dir, tmp_path,
                                             cpu_trainer_kernels):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.response_template = qwen3_template
    call_message = tokenizer.parse_response(CALL + tokenizer.eos_token, prefix="<|assistant|>")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, call_message],
                                             tokenize=False)
    assert CALL not in rendered  # re-rendering this answer would drift
    trainer = build_trainer(async_server, llama_dir, tmp_path, tokenizer)
    cpu_trainer_kernels()
    trainer.rollout_queue = tapped = TappedQueue(trainer.rollout_queue)
    trainer.rollout_worker.stop = tapped.drain_while(trainer.rollout_worker.stop)
    trainer.train()

    (step,) = [h for h in trainer.state.log_history if "rollout/fork_frac" in h]
    assert step["rollout/turns_mean"] > 1, step  # tools were called and answered
    assert step["rollout/fork_frac"] == 0 and step["rollout/realign_frac"] == 0, step
    assert step["rollout/samples_per_rollout"] == pytest.approx(1.0), step
    # The trainer takes a few groups (4 conversations of the one prompt each; 8 samples in a
    # run here), which by chance may hold no call (about 2 of 3 first turns answer plainly);
    # the groups drained beside them come from the same worker and requests.
    made = tapped.samples + tapped.drained
    called = [s for s in made if any(m.get("tool_calls") for m in s.completion)]
    assert called
    for sample in called:  # the trained row holds the call as sampled; re-rendering it drifts
        held = list(sample.input_ids)
        assert CALL in tokenizer.decode(held)
        rerendered = tokenizer.apply_chat_template(sample.prompt + sample.completion,
                                                   return_dict=False)
        assert rerendered[:len(held)] != held


@pytest.mark.timeout(180)  # TRL's stop hung after a child failed: fail, do not hang
def test_a_request_the_server_refuses_stops_the_training_at_once_with_its_reason(
        async_server, llama_dir, tmp_path, cpu_trainer_kernels):
    """A 400 (here an invalid top_k) is not retried: TRL's own worker retries every HTTP
    error for minutes; ours stops the trainer with the server's reason (and stopping the dead
    child does not hang)."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.response_template = qwen3_template
    trainer = build_trainer(async_server, llama_dir, tmp_path, tokenizer,
                            request_extras={"top_k": -7})
    cpu_trainer_kernels()
    with pytest.raises(RuntimeError, match="failed") as raised:
        trainer.train()
    cause = str(raised.value.__cause__)
    assert "RolloutRequestError" in cause and "400" in cause and "top_k" in cause, cause
