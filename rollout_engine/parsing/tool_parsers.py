"""Tool-call parsers (vLLM's `--tool-call-parser` names), one small class per format.

Every parser is fed a completion's answer text (after the reasoning parser took its part)
piece by piece and says what the pieces added: content, or whole tool calls. A call is sent
once it has closed, whole (name and arguments in one delta), so a streamed answer never has to
take back a name whose arguments turn out malformed, and it folds to the one-shot answer at
every split point. A call that does not parse stays in the content verbatim.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, any number of them, text around them.
- `qwen3_xml` (Qwen3-Coder; alias `qwen3_coder`): `<tool_call>\\n<function=NAME>\\n<parameter=P>
  \\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, values typed by the tool's schema.
- `llama3_json`: the output is `{"name": ..., "parameters": {...}}` (`;`-separated for
  several, optionally after `<|python_tag|>`).
- `pythonic` (Llama 3.2/4, ToolACE): the output is `[f(a=1), g(b="x")]`.
- `mistral`: `[TOOL_CALLS]` then a JSON array of calls, or `name[ARGS]{...}` (v11 tokenizers).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from rollout_engine.parsing.messages import MessageDelta, ToolCall, ToolCallDelta
from rollout_engine.parsing.scanner import BlockScanner, cut_before


def arguments_json(arguments: Any) -> str | None:
    """A call's arguments as OpenAI's JSON string; None unless they are a JSON object (a
    string holding one is taken too)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):
        return None


def named_call(obj: Any, arguments_keys: Sequence[str]) -> ToolCall | None:
    """`{"name": str, <one of arguments_keys>: object}` as a call; a missing arguments key
    means no arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = arguments_json({} if key is None else obj[key])
    return None if arguments is None else ToolCall(obj["name"], arguments)


class ToolParser:
    """One completion's tool calls, fed its answer text piece by piece."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool] = True
    """False where the format's markers are special tokens, which detokenizing would drop."""

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        functions = [tool.get("function") for tool in tools if isinstance(tool, dict)]
        self.parameters = {f.get("name"): f.get("parameters") or {}
                           for f in functions if isinstance(f, dict)}
        """Each tool's JSON Schema of arguments, by name."""
        self._num_calls = 0

    def feed(self, text: str) -> MessageDelta:
        raise NotImplementedError

    def finish(self) -> MessageDelta:
        raise NotImplementedError

    def _numbered(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        first, self._num_calls = self._num_calls, self._num_calls + len(calls)
        return [ToolCallDelta(first + i, call) for i, call in enumerate(calls)]


class BlockToolParser(ToolParser):
    """Calls in `start ... end` blocks, with content around them."""

    start_marker: ClassVar[str] = "<tool_call>"
    end_marker: ClassVar[str] = "</tool_call>"

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._scanner = BlockScanner(self.start_marker, self.end_marker)

    def parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> MessageDelta:
        return self._delta(self._scanner.feed(text))

    def finish(self) -> MessageDelta:
        return self._delta(self._scanner.finish())

    def _delta(self, pieces: list[tuple[str, str]]) -> MessageDelta:
        delta = MessageDelta()
        for kind, text in pieces:
            calls = None if kind == "text" else self.parse_block(text)
            if calls:
                delta.tool_calls += self._numbered(calls)
            elif kind == "text":
                delta.content += text
            else:  # a block that does not parse: the text as the model wrote it
                closing = self.end_marker if kind == "block" else ""
                delta.content += self.start_marker + text + closing
        return delta


class HermesToolParser(BlockToolParser):
    name = "hermes"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        try:
            call = named_call(json.loads(body), ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None
        return None if call is None else [call]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_TYPED = {"integer", "number", "boolean", "object", "array", "null"}


class Qwen3XmlToolParser(BlockToolParser):
    name = "qwen3_xml"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        functions = _FUNCTION.findall(body)
        if not functions or _FUNCTION.sub("", body).strip():
            return None
        calls = []
        for name, inner in functions:
            name = name.strip()
            values = {key.strip(): self._value(name, key.strip(), _strip_newline(raw))
                      for key, raw in _PARAMETER.findall(inner)}
            if _PARAMETER.sub("", inner).strip():
                return None
            calls.append(ToolCall(name, json.dumps(values, ensure_ascii=False)))
        return calls

    def _value(self, function: str, key: str, raw: str) -> Any:
        """A parameter's text as its schema types it: JSON for numbers, booleans, objects and
        arrays (Python's spellings of booleans and None too); text otherwise or if it fails."""
        schema = (self.parameters.get(function, {}).get("properties") or {}).get(key) or {}
        kind = schema.get("type")
        if kind not in _TYPED and not (isinstance(kind, list) and _TYPED.intersection(kind)):
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            pass
        try:
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return raw


def _strip_newline(raw: str) -> str:
    """A value as the format writes it: one newline after its tag and one before the close."""
    return raw.removeprefix("\n").removesuffix("\n")


class Qwen3CoderToolParser(Qwen3XmlToolParser):
    name = "qwen3_coder"


class TailToolParser(ToolParser):
    """Calls that run to the end of the output once a trigger appears: at the start of the
    output (`start_triggers`) or anywhere after content (`anywhere_trigger`). Parsed whole
    when the output ends; if they do not parse, the text is content."""

    start_triggers: ClassVar[tuple[str, ...]] = ()
    anywhere_trigger: ClassVar[str | None] = None

    def __init__(self, tools: Sequence[dict] = ()) -> None:
        super().__init__(tools)
        self._state: Literal["start", "content", "calls"] = (
            "start" if self.start_triggers else "content")
        self._held = ""
        self._calls_text: list[str] = []

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> MessageDelta:
        buffer, self._held = self._held + text, ""
        if self._state == "start":
            stripped = buffer.lstrip()
            if any(stripped.startswith(t) for t in self.start_triggers):
                self._state = "calls"
            elif not stripped or any(t.startswith(stripped) for t in self.start_triggers):
                self._held = buffer
                return MessageDelta()
            else:
                self._state = "content"
        if self._state == "content" and self.anywhere_trigger:
            before, rest, found = cut_before(buffer, self.anywhere_trigger)
            if not found:
                self._held = rest
                return MessageDelta(before)
            self._state, buffer = "calls", rest
            return MessageDelta(before).merge(self.feed(buffer)) if buffer else MessageDelta(before)
        if self._state == "calls":
            self._calls_text.append(buffer)
            return MessageDelta()
        return MessageDelta(buffer)

    def finish(self) -> MessageDelta:
        held, self._held = self._held, ""
        if self._state != "calls":
            return MessageDelta(held)
        text = "".join(self._calls_text) + held
        calls = self.parse_calls(text)
        if calls:
            return MessageDelta(tool_calls=self._numbered(calls))
        return MessageDelta((self.anywhere_trigger or "") + text)


class Llama3JsonToolParser(TailToolParser):
    name = "llama3_json"
    start_triggers = ("{", "<|python_tag|>")

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip().removeprefix("<|python_tag|>")
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and (text[at].isspace() or text[at] == ";"):
                at += 1
            if at == len(text):
                return calls or None
            try:
                obj, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            call = named_call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)


class PythonicToolParser(TailToolParser):
    name = "pythonic"
    start_triggers = ("[",)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            try:
                values = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                return None
            arguments = None if None in values else arguments_json(values)
            if arguments is None:
                return None
            calls.append(ToolCall(node.func.id, arguments))
        return calls


class MistralToolParser(TailToolParser):
    name = "mistral"
    anywhere_trigger = "[TOOL_CALLS]"
    skip_special_tokens = False

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        text = text.strip()
        if text.startswith("["):  # a JSON array of calls
            try:
                objs = json.loads(text)
            except json.JSONDecodeError:
                return None
            if not isinstance(objs, list):
                return None
            calls = [named_call(obj, ("arguments",)) for obj in objs]
            return calls if calls and None not in calls else None
        calls = []
        for part in text.split(self.anywhere_trigger):  # v11: name[ARGS]{...}, repeated
            name, marker, arguments = part.strip().partition("[ARGS]")
            arguments = arguments_json(arguments) if marker else None
            if not name or arguments is None:
                return None
            calls.append(ToolCall(name.strip(), arguments))
        return calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (
        HermesToolParser, Qwen3XmlToolParser, Qwen3CoderToolParser, Llama3JsonToolParser,
        PythonicToolParser, MistralToolParser)
}
