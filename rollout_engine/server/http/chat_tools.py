"""Tool calls and reasoning in chat answers: what a request's `tool_choice` asks (the tools in
the prompt, a constraint on the output, parsing), and the assistant message and stream deltas
in vLLM's form (`tool_calls`, `reasoning` and its older name `reasoning_content`,
`finish_reason` "tool_calls")."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_engine.config import ServerConfig
from rollout_engine.parsing import (
    ChatParser,
    ChatParsing,
    MessageDelta,
    ToolChoicePlan,
    plan_tool_choice,
)
from rollout_engine.parsing.chat_params import chat_sampling_params
from rollout_engine.protocol import SamplingParams
from rollout_engine.server.http.api_models import ChatCompletionRequest


@dataclass(frozen=True)
class ChatTools:
    """One chat request's tool choice and parsers."""

    plan: ToolChoicePlan
    parsing: ChatParsing
    request: ChatCompletionRequest
    constrain_in_reasoning: bool = False
    """Constraints apply from the first token, not once the reasoning has ended."""

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, config: ServerConfig) -> ChatTools:
        plan = plan_tool_choice(
            request.tools, request.tool_choice, request.parallel_tool_calls is not False,
            config.tool_call_parser, config.enable_auto_tool_choice,
            config.exclude_tools_when_tool_choice_none)
        return cls(plan, ChatParsing(config.reasoning_parser, config.tool_call_parser), request,
                   config.structured_outputs_in_reasoning)

    @property
    def is_parsing(self) -> bool:
        """Whether outputs are read (reasoning split, calls parsed) rather than sent as text."""
        return self.parsing.is_active(self.plan.parse_calls)

    def prompt_request(self) -> ChatCompletionRequest:
        """The request as the template renders it: without tools where the plan says so."""
        if self.plan.render_tools or not self.request.tools:
            return self.request
        return self.request.model_copy(update={"tools": None})

    def constrain(self, params: SamplingParams, prompt_text: str) -> SamplingParams:
        """The sampling params as the tool choice and parsers need them (`chat_params.py`)."""
        return chat_sampling_params(params, self.plan, self.parsing, prompt_text,
                                    self.constrain_in_reasoning)

    def parser(self, prompt_text: str) -> ChatParser | None:
        if not self.is_parsing:
            return None
        return self.parsing.parser(prompt_text, self.request.tools, self.plan.parse_calls)

    def message(self, parser: ChatParser, text: str, prefix: str) -> dict:
        """The assistant message of a whole completion."""
        parsed = parser.parse(text)
        content = prefix + (parsed.content or "") if prefix else parsed.content
        message = {"role": "assistant", "content": content,
                   "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
        return {**message, **self._reasoning(parsed.reasoning)}

    def delta(self, delta: MessageDelta) -> dict:
        """A stream chunk's `delta` (only the fields that have news)."""
        fields: dict = {}
        if delta.content:
            fields["content"] = delta.content
        fields.update(self._reasoning(delta.reasoning or None, only_news=True))
        if delta.tool_calls:
            fields["tool_calls"] = [call.to_openai() for call in delta.tool_calls]
        return fields

    def _reasoning(self, reasoning: str | None, only_news: bool = False) -> dict:
        if self.parsing.reasoning_parser is None or (only_news and not reasoning):
            return {}
        reasoning = reasoning if self.request.include_reasoning else None
        if only_news and reasoning is None:
            return {}
        return {"reasoning": reasoning, "reasoning_content": reasoning}


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """vLLM's: "tool_calls" for a completion that stopped after calling tools."""
    return "tool_calls" if has_tool_calls and reason == "stop" else reason

