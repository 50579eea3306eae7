"""One completion's assistant message: the reasoning parser takes its part of the text
first, the tool parser reads the answer that is left."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollout_engine.parsing.harmony import HarmonyParser
from rollout_engine.parsing.messages import MessageDelta, ParsedMessage
from rollout_engine.parsing.reasoning import REASONING_PARSERS, ReasoningParser
from rollout_engine.parsing.tool_parsers import TOOL_PARSERS, ToolParser


class _Trimmed:
    """A text channel without its surrounding whitespace, as it streams: leading whitespace is
    dropped, a trailing run held back until more text follows it (and dropped at the end)."""

    def __init__(self) -> None:
        self._has_started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._has_started:
            text = text.lstrip()
            self._has_started = bool(text)
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out, self._held = self._held + body, text[len(body):]
        return out


class ChatParser:
    """Fed a completion's text piece by piece (`feed`, then `finish` once), or whole
    (`parse`); either way in time linear in the text. Content and reasoning come without
    their surrounding whitespace (the `\n\n` after `</think>`, around calls), as transformers'
    `parse_response` gives them."""

    def __init__(self, reasoning: ReasoningParser | HarmonyParser | None,
                 tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self._content, self._reasoning = _Trimmed(), _Trimmed()

    def feed(self, text: str) -> MessageDelta:
        delta = self.reasoning.feed(text) if self.reasoning else MessageDelta(text)
        return self._trimmed(self._read_answer(delta, finish=False))

    def finish(self) -> MessageDelta:
        delta = self.reasoning.finish() if self.reasoning else MessageDelta()
        return self._trimmed(self._read_answer(delta, finish=True))

    def _trimmed(self, delta: MessageDelta) -> MessageDelta:
        return MessageDelta(self._content.feed(delta.content),
                            self._reasoning.feed(delta.reasoning), delta.tool_calls)

    def parse(self, text: str) -> ParsedMessage:
        return ParsedMessage.fold([self.feed(text), self.finish()])

    def _read_answer(self, delta: MessageDelta, finish: bool) -> MessageDelta:
        if self.tools is None:
            return delta
        answer = self.tools.feed(delta.content) if delta.content else MessageDelta()
        if finish:
            answer = answer.merge(self.tools.finish())
        return MessageDelta(answer.content, delta.reasoning, answer.tool_calls)


HARMONY_REASONING = "openai_gptoss"
REASONING_NAMES = frozenset(REASONING_PARSERS) | {HARMONY_REASONING}
TOOL_NAMES = frozenset(TOOL_PARSERS) | {HarmonyParser.name}
"""Every parser name (vLLM's), gpt-oss's harmony pair included."""


@dataclass(frozen=True)
class ChatParsing:
    """A server's parsers (vLLM's `--reasoning-parser` and `--tool-call-parser`), by name,
    checked once; `parser(...)` builds one completion's ChatParser."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        for kind, name, known in (("reasoning", self.reasoning_parser, REASONING_NAMES),
                                  ("tool-call", self.tool_call_parser, TOOL_NAMES)):
            if name is not None and name not in known:
                raise ValueError(f"unknown {kind} parser {name!r}; choose from {sorted(known)}")
        if self.is_harmony and not (self.tool_call_parser in (None, HarmonyParser.name) and
                                    self.reasoning_parser in (None, HARMONY_REASONING)):
            raise ValueError("gpt-oss's harmony format is read whole: pair --tool-call-parser "
                             f"openai with --reasoning-parser {HARMONY_REASONING} (or none)")

    @property
    def is_harmony(self) -> bool:
        return HarmonyParser.name == self.tool_call_parser or (
            self.reasoning_parser == HARMONY_REASONING)

    @property
    def skip_special_tokens(self) -> bool:
        """False where the format's markers are special tokens."""
        if self.is_harmony:
            return False
        name = self.tool_call_parser
        return name is None or TOOL_PARSERS[name].skip_special_tokens

    def is_active(self, parse_calls: bool) -> bool:
        has_tool_parser = self.tool_call_parser is not None
        return self.reasoning_parser is not None or (parse_calls and has_tool_parser)

    def parser(self, prompt_text: str, tools: Sequence[dict] | None, parse_calls: bool
               ) -> ChatParser:
        if self.is_harmony:  # one parser reads reasoning, content and calls
            harmony = HarmonyParser(parse_calls and self.tool_call_parser is not None)
            return ChatParser(harmony, None)
        reasoning = (REASONING_PARSERS[self.reasoning_parser](prompt_text)
                     if self.reasoning_parser else None)
        tool_parser = (TOOL_PARSERS[self.tool_call_parser](tools or ())
                       if parse_calls and self.tool_call_parser else None)
        return ChatParser(reasoning, tool_parser)
