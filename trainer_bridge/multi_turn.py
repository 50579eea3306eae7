"""Multi-turn tool rollouts whose tokens are exactly the ones the policy sampled.

`multi_turn_rollouts(client, conversations, tools, params, tool_parser=...)` runs every
conversation as an agent loop: the policy answers, its tool calls are parsed and run, the tools'
answers go back as `tool` messages, and the policy answers again, until it calls no tool or
`max_turns` is reached. All conversations advance together, one batched generate per turn.

Turn k+1's prompt is turn k's prompt and completion ids as sampled, then the tokens of what the
chat template renders after them (RenderChat with `tokens`, the server's token-in chat): no turn
is ever tokenized again, so decode -> re-encode drift cannot happen, each conversation is one
training sample, and the engine's prefix cache serves every earlier turn (each turn asks the
engine to keep its KV warm for the next, `kv_keep_alive_s`; an `EnginePool` sends every turn
of a conversation to the engine that holds it).

Each `MultiTurnRollout` is what a trainer needs: the first prompt's ids, then `completion_ids`
(every later token), `completion_mask` (1: sampled by the policy, 0: added by tools and the
template), `completion_logprobs` (the sampling logprob of each sampled token, 0.0 elsewhere),
and per turn the weight versions that sampled it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_engine.parsing import ChatParsing, ParsedMessage
from rollout_engine.parsing.chat_params import (
    attach_messages,
    chat_sampling_params,
    offline_tool_choice,
)
from rollout_engine.protocol import (
    EngineError,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    WeightVersionSpan,
)
from trainer_bridge.engine_pool import EnginePool

Messages = list[dict[str, Any]]


@dataclass
class Turn:
    """One generation of a conversation."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    weight_versions: list[WeightVersionSpan]
    """Which weights sampled which of this turn's tokens (spans over `token_ids`)."""
    message: ParsedMessage | None
    num_cached_tokens: int | None
    """Prompt tokens the engine's prefix cache served."""


@dataclass
class MultiTurnRollout:
    """One conversation rolled out: its tokens, which of them the policy sampled, their
    logprobs, and the messages (the first ones, then assistant and tool messages)."""

    messages: Messages
    prompt_token_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    num_tool_calls: int = 0
    num_tool_failures: int = 0
    stopped: str | None = None
    """Why it ended: "answer" (no tool call), "max_turns" (a call left unanswered) or
    "max_model_len" (the next prompt would not fit the model)."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.completion_ids

    def add_turn(self, turn: Turn) -> None:
        """Record a turn whose prompt extends this rollout's tokens."""
        if not self.turns:
            self.prompt_token_ids = list(turn.prompt_token_ids)
        else:
            history = self.token_ids
            if turn.prompt_token_ids[:len(history)] != history:
                raise EngineError("the engine's prompt does not extend the conversation's "
                                  "tokens (token-in chat broke its contract)")
            added = turn.prompt_token_ids[len(history):]
            self._append(added, 0, [0.0] * len(added))
        self._append(turn.token_ids, 1, turn.logprobs)
        self.turns.append(turn)

    def _append(self, ids: list[int], mask: int, logprobs: list[float]) -> None:
        assert len(ids) == len(logprobs), (len(ids), len(logprobs))
        self.completion_ids += ids
        self.completion_mask += [mask] * len(ids)
        self.completion_logprobs += logprobs


def multi_turn_rollouts(
    client: Any,
    conversations: Sequence[Messages],
    tools: Sequence[Callable[..., Any]],
    sampling_params: SamplingParams | None = None,
    *,
    tool_parser: str,
    reasoning_parser: str | None = None,
    tool_choice: str | dict[str, Any] = "auto",
    parallel_tool_calls: bool = True,
    max_turns: int = 8,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    kv_keep_alive_s: float = 30.0,
    timeout: float | None = None,
) -> list[MultiTurnRollout]:
    """Roll out every conversation (see the module's docstring). `client`: an EngineClient or
    an EnginePool; `tools`: Python functions with type hints and docstrings (their schemas are
    what the template shows, as in TRL); `sampling_params.n` must be 1 (repeat a conversation
    for a group). A tool that raises answers `{"error": ...}`; an unknown tool name too."""
    from transformers.utils import get_json_schema

    params = sampling_params or SamplingParams()
    if params.n != 1:
        raise InvalidRequestError("multi-turn rollouts sample one completion per conversation "
                                  "(n=1); repeat a conversation to sample a group")
    if max_turns < 1:
        raise InvalidRequestError(f"max_turns must be >= 1, got {max_turns}")
    params = dataclasses.replace(params, kv_keep_alive_s=kv_keep_alive_s)
    schemas = [get_json_schema(tool) for tool in tools]
    functions = {schema["function"]["name"]: tool for schema, tool in zip(schemas, tools)}
    parsing = ChatParsing(reasoning_parser, tool_parser)
    plan = offline_tool_choice(schemas, tool_choice, tool_parser, parallel_tool_calls)
    render_options = {"tools": schemas if plan.render_tools else None,
                      "chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs}
    max_model_len = client.info().max_model_len
    rollouts = [MultiTurnRollout([dict(m) for m in conversation], [])
                for conversation in conversations]
    session_ids = [uuid.uuid4().hex for _ in rollouts]
    active = list(range(len(rollouts)))
    for turn_index in range(max_turns):
        prompts = {}
        for i in active:
            rollout = rollouts[i]
            history = rollout.token_ids if rollout.turns else None
            token_ids, text = client.render_chat(rollout.messages, **render_options,
                                                 tokens=history)
            if len(token_ids) >= max_model_len:
                rollout.stopped = "max_model_len"
                continue
            prompts[i] = (token_ids, text)
        active = list(prompts)
        if not active:
            break
        turn_params = [chat_sampling_params(
            dataclasses.replace(params, max_tokens=min(
                params.max_tokens, max_model_len - len(prompts[i][0]))),
            plan, parsing, prompts[i][1]) for i in active]
        generate_options = ({"session_ids": [session_ids[i] for i in active]}
                            if isinstance(client, EnginePool) else {})
        outputs = client.generate([prompts[i][0] for i in active], turn_params, timeout=timeout,
                                  **generate_options)
        attach_messages(outputs, [prompts[i][1] for i in active], parsing, plan, schemas)
        still_active = []
        for i, output in zip(active, outputs):
            rollout = rollouts[i]
            (completion,) = output.outputs
            rollout.add_turn(Turn(output.prompt_token_ids, list(completion.token_ids),
                                  list(completion.logprobs), completion.finish_reason,
                                  list(completion.weight_versions), completion.message,
                                  output.num_cached_tokens))
            message = completion.message or ParsedMessage(completion.text, None)
            rollout.messages.append(_assistant_message(message))
            if not message.tool_calls or completion.finish_reason != "stop":
                rollout.stopped = "answer"
            elif turn_index == max_turns - 1:
                rollout.stopped = "max_turns"
            else:
                rollout.messages += _run_tools(rollout, message, functions)
                still_active.append(i)
        active = still_active
    return rollouts


def _assistant_message(message: ParsedMessage) -> dict[str, Any]:
    assistant: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.reasoning is not None:
        assistant["reasoning_content"] = message.reasoning
    if message.tool_calls:
        assistant["tool_calls"] = [call.to_openai() for call in message.tool_calls]
    return assistant


def _run_tools(rollout: MultiTurnRollout, message: ParsedMessage,
               functions: dict[str, Callable[..., Any]]) -> Messages:
    """The tool messages answering the message's calls, in order."""
    answers = []
    for call in message.tool_calls:
        rollout.num_tool_calls += 1
        try:
            function = functions.get(call.name)
            if function is None:
                raise KeyError(f"unknown tool {call.name!r}")
            arguments = json.loads(call.arguments)
            if not isinstance(arguments, dict):
                raise TypeError("tool arguments must be a JSON object")
            result = function(**arguments)
        except Exception as exc:  # noqa: BLE001 - the policy's call failed; it hears why
            rollout.num_tool_failures += 1
            result = {"error": f"{type(exc).__name__}: {exc}"}
        content = result if isinstance(result, str) else json.dumps(result, default=str)
        answers.append({"role": "tool", "name": call.name, "tool_call_id": call.id,
                        "content": content})
    return answers
