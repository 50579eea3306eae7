"""Tool-call and reasoning parsers: a generated corpus per format parses to what was written,
malformed calls stay in the content, and every way of cutting the text into stream pieces
gives the one-shot answer."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from rollout_engine.parsing import ChatParsing, ParsedMessage

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "detail": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "exact": {"type": "boolean"},
                                         "tags": {"type": "array"}}}}},
]
WORDS = ["Paris", "naïve café", "東京", "a \"quoted\" word", "back\\slash", "line\nbreak", "🙂",
         "<tag>", "{braces}", "[x]", "semi;colon", ""]


def random_arguments(rng: random.Random) -> tuple[str, dict]:
    if rng.random() < 0.5:
        return "get_weather", {"city": rng.choice(WORDS), "days": rng.randint(-5, 400),
                               "detail": {"nested": [rng.choice(WORDS), {"deep": rng.random() < 0.5}]}}
    return "search", {"query": rng.choice(WORDS), "exact": rng.random() < 0.5,
                      "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 3))]}


def hermes_call(name: str, arguments: dict, rng: random.Random) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, 2]))
    return f"<tool_call>\n{body}\n</tool_call>"


def qwen3_xml_call(name: str, arguments: dict, rng: random.Random) -> str:
    parameters = "".join(
        f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
        for key, value in arguments.items() if "</parameter>" not in str(value))
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def corpus_case(rng: random.Random, write_call) -> tuple[str, ParsedMessage]:
    """A text of content pieces and calls (block formats), with what it must parse to."""
    content, calls, text = [], [], []
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.5:
            piece = rng.choice(["Let me check. ", "\n", "Done: ", "ok ", "<tool", "</tool_call> "])
            content.append(piece)
            text.append(piece)
        name, arguments = random_arguments(rng)
        calls.append((name, arguments))
        text.append(write_call(name, arguments, rng))
    if rng.random() < 0.5:
        content.append(" thanks")
        text.append(" thanks")
    expected_content = "".join(content).strip() or None  # surrounding whitespace goes
    return "".join(text), ParsedMessage(expected_content, None, tuple(
        (name, arguments) for name, arguments in calls))


def comparable(message: ParsedMessage) -> tuple:
    return (message.content, message.reasoning,
            tuple((c.name, json.loads(c.arguments)) for c in message.tool_calls))


def parse(text: str, tool_parser: str | None = "hermes", reasoning: str | None = None,
          prompt: str = "", cuts: list[int] | None = None) -> ParsedMessage:
    parser = ChatParsing(reasoning, tool_parser).parser(prompt, TOOLS, parse_calls=True)
    if cuts is None:
        return parser.parse(text)
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    return ParsedMessage.fold([*deltas, parser.finish()])


def assert_stream_invariant(text: str, **options) -> None:
    """Every cut into two pieces, and one character at a time, give the one-shot answer."""
    whole = comparable(parse(text, **options))
    for cut in range(len(text) + 1):
        assert comparable(parse(text, cuts=[cut], **options)) == whole, (cut, text)
    assert comparable(parse(text, cuts=list(range(1, len(text))), **options)) == whole, text


@pytest.mark.parametrize(("parser", "write_call"), [("hermes", hermes_call),
                                                    ("qwen3_xml", qwen3_xml_call)])
def test_block_formats_parse_a_generated_corpus_at_every_split(parser, write_call):
    rng = random.Random(0)
    for _ in range(40):
        text, expected = corpus_case(rng, write_call)
        if parser == "qwen3_xml":  # parameters whose text holds the closing tag are not written
            expected = ParsedMessage(expected.content, None, tuple(
                (n, {k: v for k, v in a.items() if "</parameter>" not in str(v)})
                for n, a in expected.tool_calls))
        got = parse(text, parser)
        assert comparable(got)[:2] == (expected.content, None), text
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == list(
            expected.tool_calls), text
        assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)
    for _ in range(6):
        assert_stream_invariant(corpus_case(rng, write_call)[0], tool_parser=parser)


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call> after",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}',
])
def test_malformed_hermes_calls_stay_in_the_content_verbatim(text):
    got = parse(text)
    assert got.tool_calls == () and got.content == text.strip()
    assert_stream_invariant(text)


def test_an_unterminated_last_call_still_parses():
    got = parse('Sure.<tool_call>\n{"name": "search", "arguments": {"query": "x"}}')
    assert got.content == "Sure." and [(c.name, c.arguments) for c in got.tool_calls] == [
        ("search", '{"query": "x"}')]


def test_qwen3_xml_values_take_their_schema_types():
    text = ("<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
            "<parameter=exact>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>")
    (call,) = parse(text, "qwen3_xml").tool_calls
    assert json.loads(call.arguments) == {"query": "42", "exact": True, "tags": ["a", 1],
                                          "other": "7"}


@pytest.mark.parametrize(("parser", "text", "calls", "content"), [
    ("llama3_json", ('{"name": "search", "parameters": {"query": "é"}}; {"name": "get_weather", '
     '"parameters": {"city": "P"}}'), [("search", {"query": "é"}), ("get_weather", {"city": "P"})],
     None),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {}}', [("search", {})], None),
    ("llama3_json", "The answer is {x}.", [], "The answer is {x}."),
    ("llama3_json", ' {"name": broken', [], '{"name": broken'),
    ("pythonic", '[search(query="a, b", exact=True), get_weather(city="P", days=3)]',
     [("search", {"query": "a, b", "exact": True}), ("get_weather", {"city": "P", "days": 3})],
     None),
    ("pythonic", "[search(open('x'))]", [], "[search(open('x'))]"),
    ("pythonic", "Plain [text] answer", [], "Plain [text] answer"),
    ("mistral", 'Hi [TOOL_CALLS][{"name": "search", "arguments": {"query": "q"}}]',
     [("search", {"query": "q"})], "Hi"),
    ("mistral", '[TOOL_CALLS]search[ARGS]{"query": "q"}[TOOL_CALLS]get_weather[ARGS]{}',
     [("search", {"query": "q"}), ("get_weather", {})], None),
    ("mistral", "[TOOL_CALLS]nonsense", [], "[TOOL_CALLS]nonsense"),
])
def test_tail_formats(parser, text, calls, content):
    got = parse(text, parser)
    assert comparable(got) == (content, None, tuple(calls))
    assert_stream_invariant(text, tool_parser=parser)


@pytest.mark.parametrize(("reasoning", "prompt", "text", "expected"), [
    ("qwen3", "", "<think>\nstep 1\n</think>\n\nAnswer", ("Answer", "step 1")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "step 1\n</think>\n\nAnswer",
     ("Answer", "step 1")),
    ("qwen3", "", "<think>\n\n</think>\n\n  ", (None, None)),
    ("qwen3", "<think>\n\n</think>\n\n", "Just an answer", ("Just an answer", None)),
    ("qwen3", "", "No thinking < here", ("No thinking < here", None)),
    ("qwen3", "", "<think>cut off by max_tokens", (None, "cut off by max_tokens")),
    ("deepseek_r1", "", "thinking</think>answer", ("answer", "thinking")),
    ("deepseek_r1", "", "<think>thinking</think>answer", ("answer", "thinking")),
    ("deepseek_r1", "", "all thought", (None, "all thought")),
])
def test_reasoning_parsers(reasoning, prompt, text, expected):
    got = parse(text, None, reasoning, prompt)
    assert (got.content, got.reasoning) == expected
    assert_stream_invariant(text, tool_parser=None, reasoning=reasoning, prompt=prompt)


def test_calls_inside_reasoning_stay_in_the_reasoning_and_calls_after_it_parse():
    text = ('<think>I could <tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
            '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n'
            '</tool_call>')
    got = parse(text, "hermes", "qwen3")
    assert "<tool_call>" in got.reasoning and got.content is None
    assert [c.name for c in got.tool_calls] == ["get_weather"]
    assert_stream_invariant(text, tool_parser="hermes", reasoning="qwen3")


def test_unknown_parser_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        ChatParsing(tool_call_parser="nope")
    with pytest.raises(ValueError, match="qwen3"):
        ChatParsing(reasoning_parser="nope")


def test_constrained_arguments_hold_only_the_declared_parameters():
    from rollout_engine.parsing.tool_choice import strict

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "c": {"type": "array", "items": {"type": "object", "properties": {}}},
        "d": {"type": "object", "properties": {}, "additionalProperties": True}}}
    out = strict(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["d"]["additionalProperties"] is True  # said so: kept
    assert "additionalProperties" not in schema  # the tool's own schema is left alone


ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
WEATHER_CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather "
                '<|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.mark.parametrize(("text", "expected"), [
    (ANALYSIS + WEATHER_CALL, (None, "Need the weather.", [("get_weather", {"city": "Paris"})])),
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
     ("Sunny.", "Need the weather.", [])),
    ("<|channel|>final<|message|>Sunny, the stop token", ("Sunny, the stop token", None, [])),
    (("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.search"
     "<|channel|>commentary json<|message|>{}<|call|>"), ("Checking.", None, [("search", {})])),
    (ANALYSIS + WEATHER_CALL.replace('{"city": "Paris"}', "{broken"),
     ("{broken", "Need the weather.", [])),
    ("no harmony here", ("no harmony here", None, [])),
])
def test_harmony(text, expected):
    content, reasoning, calls = expected
    got = parse(text, "openai", "openai_gptoss")
    assert comparable(got) == (content, reasoning, tuple(calls))
    assert comparable(parse(text, "openai")) == comparable(got)  # the pair or the tool side
    assert_stream_invariant(text, tool_parser="openai", reasoning="openai_gptoss")


def test_harmony_is_read_whole_and_keeps_its_special_tokens():
    assert not ChatParsing(tool_call_parser="openai").skip_special_tokens
    with pytest.raises(ValueError, match="harmony"):
        ChatParsing(reasoning_parser="qwen3", tool_call_parser="openai")
    got = parse(ANALYSIS + WEATHER_CALL, None, "openai_gptoss")  # reasoning only: no calls
    assert got.tool_calls == () and got.reasoning == "Need the weather."


def test_a_tool_choice_over_a_nameless_tool_is_a_clear_error():
    from rollout_engine.parsing import plan_tool_choice
    from rollout_engine.protocol import InvalidRequestError

    nameless = [{"type": "function", "function": {"parameters": {"type": "object"}}}]
    for choice in ("auto", "required"):
        with pytest.raises(InvalidRequestError, match="needs a string `name`"):
            plan_tool_choice(nameless, choice, True, "hermes", True)
