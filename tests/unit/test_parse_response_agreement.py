"""Our parsers against transformers' `parse_response` with TRL's response templates (what TRL's
trainers parse client-side): on generated corpora of Qwen3 answers (reasoning, text, calls with
nested and unicode arguments, in hermes JSON and in Qwen3.5's XML), Llama 3 JSON calls and
gpt-oss harmony, the same reasoning, content and calls. Where they differ on purpose, the case is left out and said here: text *after* a
call (transformers keeps only the last text segment, we keep all of it) and a malformed call
(transformers raises, we keep the call's text as content)."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from rollout_engine.parsing import ChatParsing

trl_templates = pytest.importorskip("trl.chat_template_utils")
PREFIX = "<|im_start|>assistant\n"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "exact": {"type": "boolean"},
        "filters": {"type": "object"}, "tags": {"type": "array"}}}}}]
TEXTS = ["Paris", "naïve café ☕", "東京", 'say "hi"', "a\\b", "x < y", "50%", "line one"]


def arguments(rng: random.Random) -> dict:
    return {"city": rng.choice(TEXTS), "days": rng.randint(-3, 900), "exact": rng.random() < .5,
            "filters": {"near": [rng.choice(TEXTS), {"deep": rng.randint(0, 9)}]},
            "tags": [rng.choice(TEXTS) for _ in range(rng.randint(0, 2))]}


def hermes(args: dict, rng: random.Random) -> str:
    body = json.dumps({"name": "lookup", "arguments": args}, ensure_ascii=rng.random() < .5)
    return f"<tool_call>\n{body}\n</tool_call>"


def xml(args: dict, rng: random.Random) -> str:
    def value(v):
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    parameters = "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function=lookup>\n{parameters}</function>\n</tool_call>"


def corpus(write_call, seed: int) -> list[tuple[str, list[dict]]]:
    rng, cases = random.Random(seed), []
    for _ in range(60):
        text = ""
        if rng.random() < 0.6:
            text += f"<think>\n{rng.choice(TEXTS)} then {rng.choice(TEXTS)}\n</think>\n\n"
        if rng.random() < 0.6:
            text += rng.choice(["Let me check.", "One moment:", "好的。"]) + "\n"
        calls = [arguments(rng) for _ in range(rng.randint(0, 3))]
        text += "\n".join(write_call(args, rng) for args in calls)
        if not calls and not text:
            text = "Just an answer."
        cases.append((text, calls))
    return cases


@pytest.mark.parametrize(("template", "tool_parser", "write_call"), [
    ("qwen3_template", "hermes", hermes), ("qwen3_5_template", "qwen3_xml", xml)])
def test_we_parse_what_transformers_parse_response_parses(llama_dir, template, tool_parser,
                                                            write_call):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.response_template = getattr(trl_templates, template)
    parsing = ChatParsing("qwen3", tool_parser)
    for text, calls in corpus(write_call, seed=len(template)):
        theirs = tokenizer.parse_response(text, prefix=PREFIX, tools=TOOLS)
        ours = parsing.parser(PREFIX, TOOLS, parse_calls=True).parse(text)
        assert ours.reasoning == theirs.get("reasoning_content"), text
        assert ours.content == (theirs.get("content") or None), text
        their_calls = [c["function"] for c in theirs.get("tool_calls", [])]
        assert [(c.name, json.loads(c.arguments)) for c in ours.tool_calls] == [
            (c["name"], c["arguments"]) for c in their_calls], text
        assert [json.loads(c.arguments) for c in ours.tool_calls] == calls, text


def test_llama3_json_and_harmony_agree_with_parse_response(llama_dir):
    """One call or an answer per output (these templates read one); their stop tokens
    (`<|eot_id|>`, `<|call|>`, `<|return|>`) end the text parse_response is given."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(3)
    for _ in range(40):
        args = arguments(rng)
        answer = rng.choice(TEXTS)
        if rng.random() < 0.5:
            llama, calls = json.dumps({"name": "lookup", "parameters": args}), [args]
        else:
            llama, calls = answer, []
        cases = [("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n",
                  llama, "<|eot_id|>", ChatParsing(tool_call_parser="llama3_json"))]
        thought = f"<|channel|>analysis<|message|>{rng.choice(TEXTS)}<|end|>"
        if calls:
            harmony = (thought + "<|start|>assistant to=functions.lookup<|channel|>commentary "
                       f"json<|message|>{json.dumps(args)}")
            end = "<|call|>"
        else:
            harmony = thought + f"<|start|>assistant<|channel|>final<|message|>{answer}"
            end = "<|return|>"
        cases.append(("gptoss", "<|start|>assistant", harmony, end,
                      ChatParsing("openai_gptoss", "openai")))
        for template, prefix, text, stop, parsing in cases:
            tokenizer.response_template = getattr(trl_templates, f"{template}_template")
            theirs = tokenizer.parse_response(text + stop, prefix=prefix, tools=TOOLS)
            ours = parsing.parser(prefix, TOOLS, parse_calls=True).parse(text)
            their_calls = [c["function"] for c in theirs.get("tool_calls", [])]
            assert [(c.name, json.loads(c.arguments)) for c in ours.tool_calls] == [
                (c["name"], c["arguments"]) for c in their_calls] == [
                ("lookup", a) for a in calls], text
            assert ours.content == (theirs.get("content") or None), text
            assert ours.reasoning == theirs.get("thinking"), text
