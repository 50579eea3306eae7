"""The sampling params of one chat request, as its tool choice and parsers need them: the
tool-choice grammar (in the parser's format), every constraint moved after the reasoning
(unless `constrain_in_reasoning`), special tokens kept where the format is written in them.
One place for `serve`, `LLM.chat` and `EngineClient.chat`, and the offline side's tool-choice
default and parsed messages."""

from __future__ import annotations

import dataclasses

from rollout_engine.parsing.chat_parser import ChatParsing
from rollout_engine.parsing.reasoning_constraint import after_reasoning
from rollout_engine.parsing.tool_choice import ToolChoicePlan, plan_tool_choice
from rollout_engine.protocol.exceptions import InvalidRequestError
from rollout_engine.protocol.outputs import RequestOutput
from rollout_engine.protocol.sampling_params import SamplingParams, StructuredOutputsParams


def chat_sampling_params(params: SamplingParams, plan: ToolChoicePlan, parsing: ChatParsing,
                         prompt_text: str, constrain_in_reasoning: bool = False
                         ) -> SamplingParams:
    changes: dict = {}
    constraint = params.structured_outputs
    if plan.grammar is not None:
        if constraint is not None:
            raise InvalidRequestError(
                "this tool_choice ('required', a named function, or 'auto' with a strict "
                "tool) constrains the output itself: send no structured_outputs or "
                "response_format with it")
        constraint = changes["structured_outputs"] = StructuredOutputsParams(grammar=plan.grammar)
    reasoning = parsing.reasoning_parser
    if constraint is not None and reasoning is not None and not constrain_in_reasoning:
        changes["structured_outputs"] = after_reasoning(constraint, reasoning, prompt_text)
    if parsing.is_active(plan.parse_calls) and not parsing.skip_special_tokens:
        changes["skip_special_tokens"] = False
    return dataclasses.replace(params, **changes) if changes else params


def offline_tool_choice(tools: list[dict] | None, tool_choice, tool_parser: str | None,
                        parallel_tool_calls: bool = True) -> ToolChoicePlan:
    """`LLM.chat` and `EngineClient.chat`: naming a tool parser is asking for auto tool choice
    (the server's `--enable-auto-tool-choice`); with no `tool_choice`, "auto" when there are
    tools and a parser, else "none"."""
    if tool_choice is None:
        tool_choice = "auto" if tools and tool_parser else "none"
    return plan_tool_choice(tools, tool_choice, parallel_tool_calls, tool_parser,
                            enable_auto_tool_choice=tool_parser is not None)


def conversations_with_tokens(messages, tokens=None
                              ) -> list[tuple[list[dict], list[int] | None]]:
    """`LLM.chat` and `EngineClient.chat` take one conversation or a list of them, and for
    token in one id list or one per conversation: the pairs, each conversation with its ids."""
    conversations = ([list(messages)] if messages and isinstance(messages[0], dict)
                     else [list(conversation) for conversation in messages])
    if tokens is None:
        return [(conversation, None) for conversation in conversations]
    per_conversation = [tokens] if tokens and isinstance(tokens[0], int) else tokens
    if len(per_conversation) != len(conversations):
        raise InvalidRequestError(f"got {len(per_conversation)} token lists for "
                                  f"{len(conversations)} conversations")
    return [(conversation, list(ids)) for conversation, ids in zip(conversations,
                                                                    per_conversation)]


def attach_messages(outputs: list[RequestOutput], prompt_texts: list[str],
                    parsing: ChatParsing, plan: ToolChoicePlan, tools: list[dict] | None
                    ) -> None:
    """Each completion's parsed message (`CompletionOutput.message`), where parsing is on."""
    if not parsing.is_active(plan.parse_calls):
        return
    for prompt_text, output in zip(prompt_texts, outputs):
        for completion in output.outputs:
            parser = parsing.parser(prompt_text, tools, plan.parse_calls)
            completion.message = parser.parse(completion.text)
