"""What a chat request's `tool_choice` asks of the engine: whether the template sees the
tools, whether the output is parsed for calls, and, for "required" and a named function, the
grammar that makes the model write its calls in the parser's own format (so a call always
parses and its arguments match the tool's schema: the format the policy is trained on, not a
bare JSON array as vLLM constrains it)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_engine.protocol.exceptions import InvalidRequestError


@dataclass(frozen=True)
class ToolChoicePlan:
    render_tools: bool
    """Whether the chat template is given the tools."""
    parse_calls: bool
    """Whether the output is parsed for tool calls."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect) the completion must follow, or None."""


def strict(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its properties
    and says nothing of others (xgrammar's strict default, OpenAI's strict tools): a call holds
    the parameters its tool declares, and a sampling model cannot wander into made-up ones."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) if key in _SUBSCHEMAS else value for key, value in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = frozenset({"items", "anyOf", "oneOf", "allOf", "not", "additionalProperties",
                         "prefixItems", "if", "then", "else"})


def call_schema(functions: Sequence[dict], arguments_key: str) -> dict:
    """The JSON Schema of one call to any of `functions`: `{"name": ..., arguments_key: ...}`
    with the name first, as the formats write it."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       arguments_key: strict(f.get("parameters") or {"type": "object"})},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for f in functions]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # json.dumps' separators and no other whitespace: the text the formats are trained on, and
    # no run of blanks for a sampling model to wander into.
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}}


def _lark_calls(body: str, separator: str, parallel: bool, opening: str = "") -> str:
    """`start` (one call, or several with `parallel`), `call` (the `opening` marker, then
    `call_body`) and `call_body`; "auto" with strict tools reuses `call_body` after the text
    that ends with the opening marker."""
    repeat = f' ("{separator}" call)*' if parallel else ""
    call = f"{_lark_string(opening)} call_body" if opening else "call_body"
    return f"start: call{repeat}\ncall: {call}\ncall_body: {body}\n"


def hermes_grammar(functions: Sequence[dict], parallel: bool) -> str:
    schema = json.dumps(call_schema(functions, "arguments"))
    return (_lark_calls('"\\n" arguments "\\n</tool_call>"', "\\n", parallel, "<tool_call>")
            + f"arguments: %json {schema}\n")


def llama3_json_grammar(functions: Sequence[dict], parallel: bool) -> str:
    schema = json.dumps(call_schema(functions, "parameters"))
    return _lark_calls("arguments", "; ", parallel) + f"arguments: %json {schema}\n"


_XML_TEXT_EXCLUDED = r"~/(?s:.*(<\/parameter>|<\/function>).*)/"
"""A text value may hold neither closing tag (the parser would end the value there)."""
_NL = "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _xml_value(schema: dict, lexeme: str) -> tuple[str, str]:
    """(the expansion of one parameter's value, the lexeme definition it needs or ""): text
    for strings (their length bounds and enums kept), JSON (compact) for every other type."""
    if schema.get("type") == "string":
        if "enum" in schema:
            return " | ".join(_lark_string(str(v)) for v in schema["enum"]), ""
        bounds = "{" + f"{int(schema.get('minLength', 0))},{schema.get('maxLength', '')}" + "}"
        return lexeme, f"{lexeme}: /(?s:.{bounds})/ & {_XML_TEXT_EXCLUDED}{_NL}"
    value = {**schema, "x-guidance": {"whitespace_flexible": False}} if schema else {}
    return f"%json {json.dumps(value or {'type': 'object'})}", ""


def qwen3_xml_grammar(functions: Sequence[dict], parallel: bool) -> str:
    """Qwen3-Coder's format: a `<parameter=P>` block per argument in the schema's order
    (required ones always, optional ones maybe), values as the parser types them back."""
    rules, lexemes, calls = [], [], []
    for i, function in enumerate(functions):
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            value, lexeme = _xml_value(schema or {}, f"TEXT_{i}_{j}")
            opening = _lark_string(f"<parameter={key}>{_NL}")
            closing = _lark_string(f"{_NL}</parameter>{_NL}")
            rules.append(f"p_{i}_{j}: {opening} ({value}) {closing}{_NL}")
            lexemes.append(lexeme)
            parts.append(f"p_{i}_{j}" + ("" if key in required else "?"))
        head = _lark_string(f"{_NL}<function={function['name']}>{_NL}")
        tail = _lark_string(f"</function>{_NL}</tool_call>")
        calls.append(" ".join([head, *parts, tail]))
    call = " | ".join(f"({c})" for c in calls)
    return (_lark_calls(call, "\\n", parallel, "<tool_call>") + "".join(rules)
            + "".join(lexemes))


CALL_GRAMMARS: dict[str, Callable[[Sequence[dict], bool], str]] = {
    "hermes": hermes_grammar,
    "llama3_json": llama3_json_grammar,
    "qwen3_xml": qwen3_xml_grammar,
    "qwen3_coder": qwen3_xml_grammar,
}
"""The parsers whose format can be constrained ("required" and named tool choices)."""


def plan_tool_choice(tools: Sequence[dict] | None, tool_choice: Any, parallel_tool_calls: bool,
                     tool_parser: str | None, enable_auto_tool_choice: bool,
                     exclude_tools_when_tool_choice_none: bool = False) -> ToolChoicePlan:
    """The plan for one request (vLLM's rules and messages where it has them);
    InvalidRequestError for a choice this server cannot honour, saying what to change."""
    tools = list(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoicePlan(render_tools=not exclude_tools_when_tool_choice_none,
                              parse_calls=False)
    functions = []  # the rest of a malformed tool is the template renderer's to refuse
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict):
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise InvalidRequestError(f"tools[{i}].function needs a string `name`")
            functions.append(function)
    if tool_choice == "auto":
        if not (enable_auto_tool_choice and tool_parser):
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice '
                                      "and --tool-call-parser to be set")
        return ToolChoicePlan(render_tools=True, parse_calls=True, grammar=_strict_auto(
            functions, tool_parser, parallel_tool_calls))
    if tool_choice == "required":
        if not functions:
            raise InvalidRequestError('tool_choice "required" needs at least one tool')
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f.get("name") == name]
        if not functions:
            raise InvalidRequestError("The tool specified in `tool_choice` does not match any "
                                      "of the specified `tools`")
    else:
        raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                                  f"{tool_choice!r}")
    return ToolChoicePlan(render_tools=True, parse_calls=True,
                          grammar=_constraint(functions, tool_parser, parallel_tool_calls
                                              and tool_choice == "required"))


STRICT_AUTO_PARSERS = frozenset({"hermes", "qwen3_xml", "qwen3_coder"})
"""The formats whose calls open with `<tool_call>`: "auto" with a `strict` tool constrains
the calls these write, and leaves the text before them free."""


def _strict_auto(functions: Sequence[dict], tool_parser: str, parallel: bool) -> str | None:
    """With a tool marked `strict: true` (OpenAI's flag), "auto" lets the model answer in free
    text and, once it opens a call, holds the call to its tool's schema (tools not marked strict
    take any object); None without a strict tool, or in a format this cannot cut."""
    if not any(f.get("strict") is True for f in functions) or tool_parser not in (
            STRICT_AUTO_PARSERS):
        return None
    loose = [f if f.get("strict") is True else {**f, "parameters": {"type": "object"}}
             for f in functions]
    calls = CALL_GRAMMARS[tool_parser](loose, parallel).splitlines(keepends=True)
    # The text before the first call is one lexeme that ends with its "<tool_call>" (so the
    # lexer never has to take text back), and the first call's body goes on from there.
    repeat = ' ("\\n" call)*' if parallel else ""
    return (f"start: FREE_TEXT | TEXT_TO_CALL call_body{repeat}\n"
            "FREE_TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n"
            "TEXT_TO_CALL: /(?s:.*<tool_call>)/ & ~/(?s:.*<tool_call>.+)/\n"
            + "".join(line for line in calls if not line.startswith("start:")))


def _constraint(functions: Sequence[dict], tool_parser: str | None, parallel: bool) -> str:
    if tool_parser is None:
        raise InvalidRequestError(
            "a 'required' or named tool_choice needs a tool-call parser (--tool-call-parser): "
            "the calls are generated in that parser's format, the one the model was trained on")
    grammar = CALL_GRAMMARS.get(tool_parser)
    if grammar is None:
        raise InvalidRequestError(
            f"the {tool_parser!r} tool-call parser cannot constrain calls yet (those that can: "
            f"{sorted(CALL_GRAMMARS)}); use tool_choice 'auto'")
    return grammar(functions, parallel)
