"""`multi_turn_rollouts` through a real server: an agent loop of random-weight tool calls whose
training sample is exactly what the policy sampled (turn after turn, the prompt extends the
previous turn's ids; the mask marks sampled tokens, their logprobs are the engine's), whose
earlier turns the prefix cache serves, and whose tools ran with the parsed arguments. Re-rendering
the same conversation gives other tokens: the control that shows the checks can fail."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from transformers import AutoTokenizer

from trainer_bridge import EngineClient, InvalidArgumentError, SamplingParams
from trainer_bridge.multi_turn import multi_turn_rollouts

BLOCK = 16
# Qwen-style: every message closed by the end-of-turn token the model samples (EOS).
TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content if m.content is string else '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}{{ eos_token }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALLS: list[dict] = []


def search(topic: Literal["cats", "dogs", "birds"]) -> str:
    """Search the notes.

    Args:
        topic: what to look for
    """
    CALLS.append({"topic": topic})
    return f"3 notes mention {topic}"


@pytest.fixture(scope="module")
def client(agent_server):
    with EngineClient(agent_server.address, timeout=120) as client:
        client.wait_until_ready(30)
        yield client


def test_rollouts_keep_the_sampled_tokens_turn_after_turn(client, llama_dir):
    CALLS.clear()
    conversations = [[{"role": "user", "content": f"Find note {i}."}] for i in range(3)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=120)
    rollouts = multi_turn_rollouts(client, conversations, [search], params, tool_parser="hermes",
                                   tool_choice="required", parallel_tool_calls=False, max_turns=3,
                                   chat_template=TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    drifted = 0
    for rollout in rollouts:
        print([(t.finish_reason, t.message, len(t.token_ids)) for t in rollout.turns])
        assert rollout.stopped == "max_turns" and len(rollout.turns) == 3
        history = []
        for k, turn in enumerate(rollout.turns):
            assert turn.finish_reason == "stop" and turn.token_ids[-1] == tokenizer.eos_token_id
            assert turn.prompt_token_ids[:len(history)] == history  # extends, token for token
            if k:
                with_kv = len(history) - 1  # the last sampled token was never fed back
                assert turn.num_cached_tokens == with_kv // BLOCK * BLOCK
            assert [s.version for s in turn.weight_versions] == [0]
            history = turn.prompt_token_ids + turn.token_ids
        assert rollout.token_ids == history
        sampled = [t for turn in rollout.turns for t in turn.token_ids]
        assert [t for t, m in zip(rollout.completion_ids, rollout.completion_mask) if m] == sampled
        logprobs = [lp for turn in rollout.turns for lp in turn.logprobs]
        assert [lp for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask)
                if m] == logprobs
        assert all(lp == 0.0 for lp, m in zip(rollout.completion_logprobs,
                                               rollout.completion_mask) if not m)
        assert rollout.num_tool_calls >= 2 and rollout.num_tool_failures == 0
        tool_messages = [m for m in rollout.messages if m["role"] == "tool"]
        assert len(tool_messages) == rollout.num_tool_calls
        assert all(m["content"].startswith("3 notes mention") for m in tool_messages)
        rerendered = tokenizer.apply_chat_template(
            rollout.messages[:-1], tools=[json.loads(json.dumps(_schema()))],
            chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
        drifted += tokenizer.encode(rerendered, add_special_tokens=False) != (
            rollout.turns[-1].prompt_token_ids)
    assert len(CALLS) == sum(r.num_tool_calls for r in rollouts)
    assert drifted  # re-rendering would not have given the sampled tokens back


def test_bad_rollout_arguments_are_refused(client):
    with pytest.raises(InvalidArgumentError, match="n=1"):
        multi_turn_rollouts(client, [[{"role": "user", "content": "x"}]], [search],
                            SamplingParams(n=2), tool_parser="hermes")
    with pytest.raises(InvalidArgumentError, match="max_turns"):
        multi_turn_rollouts(client, [[{"role": "user", "content": "x"}]], [search],
                            tool_parser="hermes", max_turns=0)


def _schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(search)


@pytest.mark.slow  # two server starts; the pool's placement is tested in test_engine_pool
def test_a_pool_keeps_every_turn_of_a_conversation_on_one_engine(llama_dir, tmp_path):
    """Through an EnginePool of two engines, each conversation's turns meet the KV of its
    earlier turns (only the engine that served them holds it), and both engines serve."""
    from trainer_bridge.engine_pool import EnginePool
    from trainer_bridge.server_process import EngineServer

    servers = [EngineServer(llama_dir, engine_options={"kv_cache_bytes": "16MiB",
                                                       "max_model_len": 1024},
                            extra_args=["--trust-request-chat-template"],
                            log_path=tmp_path / f"{name}.log") for name in "ab"]
    try:
        with EnginePool([s.address for s in servers], timeout=120) as pool:
            conversations = [[{"role": "user", "content": f"Find note {i}."}] for i in range(6)]
            rollouts = multi_turn_rollouts(
                pool, conversations, [search], SamplingParams(temperature=1.0, seed=3,
                                                              max_tokens=120),
                tool_parser="hermes", tool_choice="required", parallel_tool_calls=False,
                max_turns=3, chat_template=TEMPLATE)
            for rollout in rollouts:
                for previous, turn in zip(rollout.turns, rollout.turns[1:]):
                    with_kv = len(previous.prompt_token_ids) + len(previous.token_ids) - 1
                    assert turn.num_cached_tokens == with_kv // BLOCK * BLOCK
            served = [EngineClient(s.address).info().num_requests_total for s in servers]
            assert all(served), served
    finally:
        for server in servers:
            server.kill()
