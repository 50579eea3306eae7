"""gpt-oss's harmony format (vLLM's `--tool-call-parser openai` and `--reasoning-parser
openai_gptoss`): the output is a run of messages, each `<|channel|>NAME[ to=RECIPIENT]
[<|constrain|>json]<|message|>BODY` ended by `<|end|>`, `<|call|>` or `<|return|>`, the next
opened by `<|start|>assistant`. The `analysis` channel is reasoning, `final` (and commentary
addressed to no one, a preamble) is content, commentary `to=functions.NAME` is a call to NAME
whose body is its JSON arguments. The markers are special tokens: the text must keep them
(`skip_special_tokens=False`, which the parser asks for).
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from rollout_engine.parsing.messages import MessageDelta, ToolCall, ToolCallDelta
from rollout_engine.parsing.scanner import partial_marker_len
from rollout_engine.parsing.tool_parsers import arguments_json

MESSAGE = "<|message|>"
START = "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonyParser:
    """One completion's messages, fed piece by piece; bodies stream as they arrive."""

    name: ClassVar[str] = "openai"
    skip_special_tokens: ClassVar[bool] = False

    def __init__(self, parse_calls: bool = True) -> None:
        self.parse_calls = parse_calls
        self._state: Literal["header", "body", "between"] = "header"
        self._held = ""
        self._header: list[str] = []
        self._kind: Literal["reasoning", "content", "call"] = "content"
        self._recipient = ""
        self._body: list[str] = []  # a call's arguments so far
        self._num_calls = 0
        self._has_opened = False

    def feed(self, text: str) -> MessageDelta:
        delta, buffer = MessageDelta(), self._held + text
        self._held = ""
        while buffer:
            if self._state == "between":
                at = buffer.find(START)
                if at < 0:
                    self._held = buffer[len(buffer) - partial_marker_len(buffer, START):]
                    break
                buffer, self._state, self._header = buffer[at + len(START):], "header", []
            elif self._state == "header":
                at = buffer.find(MESSAGE)
                if at < 0:
                    keep = partial_marker_len(buffer, MESSAGE)
                    self._header.append(buffer[:len(buffer) - keep])
                    self._held = buffer[len(buffer) - keep:]
                    break
                self._header.append(buffer[:at])
                self._open("".join(self._header))
                buffer, self._state = buffer[at + len(MESSAGE):], "body"
            else:
                ends = [(buffer.find(end), end) for end in ENDS if end in buffer]
                if not ends:
                    keep = max(partial_marker_len(buffer, end) for end in ENDS)
                    self._add_body(delta, buffer[:len(buffer) - keep])
                    self._held = buffer[len(buffer) - keep:]
                    break
                at, end = min(ends)
                self._add_body(delta, buffer[:at])
                self._close(delta)
                buffer, self._state = buffer[at + len(end):], "between"
        return delta

    def finish(self) -> MessageDelta:
        """The last message ends with the output (its `<|call|>` or `<|return|>` is a stop
        token, not in the text); an output that never opened a message is content."""
        delta, held = MessageDelta(), self._held
        self._held = ""
        if self._state == "body":
            self._add_body(delta, held)
            self._close(delta)
        elif self._state == "header" and not self._has_opened:
            delta.content = "".join(self._header) + held  # not harmony at all
        return delta  # else: a cut-off header, or text between messages: nothing to say

    def _open(self, header: str) -> None:
        self._has_opened = True
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._recipient = recipient.group(1) if recipient else ""
        self._body = []
        if self._recipient.startswith("functions.") and self.parse_calls:
            self._kind = "call"
        elif channel and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"

    def _add_body(self, delta: MessageDelta, text: str) -> None:
        if self._kind == "call":
            self._body.append(text)
        elif self._kind == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text

    def _close(self, delta: MessageDelta) -> None:
        if self._kind != "call":
            return
        body = "".join(self._body)
        arguments = arguments_json(body.strip() or "{}")
        if arguments is None:  # not JSON: the body stays readable, as content
            delta.content += body
            return
        name = self._recipient.removeprefix("functions.")
        delta.tool_calls.append(ToolCallDelta(self._num_calls, ToolCall(name, arguments)))
        self._num_calls += 1
