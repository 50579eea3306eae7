"""What the parsers produce: an assistant message split into content, reasoning and tool
calls, whole (`ParsedMessage`) or as the deltas of a stream (`MessageDelta`).

A whole message is, by definition, the deltas of the stream folded together
(`ParsedMessage.fold`): the one-shot parse is the stream fed in one piece, so a streamed
answer and an unstreamed one never disagree."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    """vLLM's form of a tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object as a string (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A call as a stream announces it: this parser sends each call whole, in one delta,
    once it has closed (so a call never has to be taken back)."""

    index: int
    call: ToolCall

    def to_openai(self) -> dict:
        return {"index": self.index, **self.call.to_openai()}


@dataclass
class MessageDelta:
    """What one piece of generated text added to the message."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)

    def merge(self, other: MessageDelta) -> MessageDelta:
        return MessageDelta(self.content + other.content, self.reasoning + other.reasoning,
                            self.tool_calls + other.tool_calls)


@dataclass(frozen=True)
class ParsedMessage:
    """The assistant message: `content` None when it is empty (vLLM's answer beside tool
    calls), `reasoning` None when the model did not reason."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def fold(cls, deltas: Iterable[MessageDelta]) -> ParsedMessage:
        content, reasoning, calls = [], [], []
        for delta in deltas:
            content.append(delta.content)
            reasoning.append(delta.reasoning)
            calls.extend(d.call for d in sorted(delta.tool_calls, key=lambda d: d.index))
        return cls("".join(content) or None, "".join(reasoning) or None, tuple(calls))
