"""Structured outputs for reasoning models: the constraint applies to the answer, once the
reasoning has ended (vLLM's default with a reasoning parser), so the model thinks freely and
then writes the constrained answer (a tool call, a JSON object).

Done in the grammar itself: the constraint becomes the `answer` rule of a Lark grammar whose
start lets the reasoning come first, as the reasoning parser reads it: required where the
prompt opened the block (or the format always reasons, DeepSeek-R1), optional where the output
may open it. The reasoning is one lexeme: any text up to its first `</think>`."""

from __future__ import annotations

import json
import re

from rollout_engine.parsing.reasoning import REASONING_PARSERS
from rollout_engine.protocol.sampling_params import StructuredOutputsParams

_REASONING_LEXEMES = (
    'REASONING: /(?s:.*<\\/think>)/ & ~/(?s:.*<\\/think>.+)/\n'
    'GAP: /[ \\t\\r\\n]*/\n'
    'THINK_OPEN: "<think>"\n'
)
_START_RULE = re.compile(r"^(\s*)start(\s*:)", re.MULTILINE)
_JSON_OPTIONS = {"whitespace_flexible": False}


def answer_rule(params: StructuredOutputsParams) -> str:
    """The constraint as Lark rules whose start rule is named `answer`."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(params.json) if kind == "json" else {"type": "object"}
        schema = {**schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
        return f"answer: %json {json.dumps(schema)}\n"
    if kind == "choice":
        return "answer: " + " | ".join(json.dumps(c, ensure_ascii=False)
                                       for c in params.choice) + "\n"
    if kind == "regex":
        return "answer: /" + params.regex.replace("/", "\\/") + "/\n"
    return rename_start_rule(params.grammar, "answer")


def rename_start_rule(grammar: str, name: str) -> str:
    """A Lark grammar whose `start` rule is called `name`, to embed it in another."""
    return _START_RULE.sub(rf"\1{name}\2", grammar)


def after_reasoning(params: StructuredOutputsParams, reasoning_parser: str,
                    prompt_text: str) -> StructuredOutputsParams:
    """`params` applied once the reasoning `reasoning_parser` reads has ended."""
    parser = REASONING_PARSERS[reasoning_parser](prompt_text)
    if parser.prompt_opens_block(prompt_text) or parser.without_start_marker == "reasoning":
        start = "start: REASONING GAP answer\n"
    else:
        start = "start: (THINK_OPEN REASONING GAP)? answer\n"
    return StructuredOutputsParams(grammar=start + _REASONING_LEXEMES + answer_rule(params))
