"""Constraints after reasoning: the grammar lets the model think first and holds the answer to
the constraint, as the reasoning parser reads the output (checked token by token with the real
grammar compiler and tokenizer)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rollout_engine import LLM, SamplingParams
from rollout_engine.core.structured_output import GrammarCompiler
from rollout_engine.parsing.reasoning_constraint import after_reasoning
from rollout_engine.parsing.tool_choice import hermes_grammar
from rollout_engine.protocol import StructuredOutputsParams

OPEN_PROMPT = "<|user|>hi\n<|assistant|><think>\n"
JSON = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"], "additionalProperties": False})


@pytest.fixture(scope="module")
def compiler(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint takes every token of `text` and is complete after it."""
    tokenizer, grammar_compiler = compiler
    matcher = grammar_compiler.compile(params).result().matcher.deep_copy()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)
               ) and matcher.is_accepting()


@pytest.mark.parametrize(("reasoning", "prompt", "text", "ok"), [
    ("qwen3", OPEN_PROMPT, 'Think {"a": "no"} <b>x</b></think>\n\n{"a":1}', True),
    ("qwen3", OPEN_PROMPT, '{"a":1}', False),  # the prompt opened the block: it must end
    ("qwen3", OPEN_PROMPT, 'x</think>\n\n{"a":"1"}', False),
    ("qwen3", OPEN_PROMPT, "x</think>y</think>{\"a\":1}", False),  # reasoning ends once
    ("qwen3", "<|assistant|>", '{"a":1}', True),  # no block: the answer at once
    ("qwen3", "<|assistant|>", '<think>hm</think>\n{"a":2}', True),
    ("qwen3", "<|assistant|>", 'hm</think>{"a":2}', False),
    ("deepseek_r1", "", 'hm</think>{"a":2}', True),
    ("deepseek_r1", "", '<think>hm</think>{"a":2}', True),
    ("deepseek_r1", "", '{"a":2}', False),
])
def test_json_after_reasoning(compiler, reasoning, prompt, text, ok):
    assert accepts(compiler, after_reasoning(JSON, reasoning, prompt), text) is ok


def test_every_kind_of_constraint_can_follow_reasoning(compiler):
    thought = "a thought</think>\n\n"
    cases = [
        (StructuredOutputsParams(choice=["yes", "no way"]), "no way", "maybe"),
        (StructuredOutputsParams(regex=r"[0-9]+/[0-9]+"), "3/4", "3-4"),
        (StructuredOutputsParams(json_object=True), '{"k":[1]}', "[1]"),
        (StructuredOutputsParams(grammar='start: "a" b\nb: "c"+\n'), "acc", "ab"),
        (StructuredOutputsParams(grammar=hermes_grammar(
            [{"name": "f", "parameters": {"type": "object"}}], False)),
         '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', '{"name": "f"}'),
    ]
    for params, good, bad in cases:
        wrapped = after_reasoning(params, "qwen3", OPEN_PROMPT)
        assert accepts(compiler, wrapped, thought + good), (params, good)
        assert not accepts(compiler, wrapped, thought + bad), (params, bad)
        assert accepts(compiler, params, good)  # the same answer, unwrapped


def test_chat_lets_a_random_model_reason_freely_before_the_constraint(llama_dir):
    """Constrained from the first token, every completion would be "yes" or "no"; after the
    reasoning, a random model thinks (and, never writing "</think>", thinks to the end)."""
    llm = LLM(str(llama_dir), kv_cache_bytes=8 << 20, max_model_len=256)
    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if add_generation_prompt %}<think>\n{% endif %}")
    params = SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (output,) = llm.chat([{"role": "user", "content": "ok?"}], params, chat_template=template,
                         reasoning_parser="qwen3")
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in output.outputs)
    assert all(c.message.reasoning == c.text.strip() and c.message.content is None
               for c in output.outputs)
    (plain,) = llm.chat([{"role": "user", "content": "ok?"}], params, chat_template=template)
    assert {c.text for c in plain.outputs} <= {"yes", "no"}


def test_auto_with_a_strict_tool_constrains_only_the_calls(compiler):
    from rollout_engine.parsing import plan_tool_choice

    strict_tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    loose_tool = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"b": {"type": "string"}}}}}
    plan = plan_tool_choice([strict_tool, loose_tool], "auto", True, "hermes", True)
    params = StructuredOutputsParams(grammar=plan.grammar)
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format
    assert accepts(compiler, params, "Just text, no call < at all.")
    assert accepts(compiler, params, "Sure: " + call("f", '{"a": 3}'))
    assert accepts(compiler, params, call("g", '{"anything": [1]}'))  # not strict: any object
    assert not accepts(compiler, params, "Sure: " + call("f", '{"a": "3"}'))
    assert not accepts(compiler, params, call("f", '{"a": 3, "extra": 1}'))
    assert not accepts(compiler, params, call("h", "{}"))
    assert plan_tool_choice([loose_tool], "auto", True, "hermes", True).grammar is None
    assert plan_tool_choice([strict_tool], "auto", True, "pythonic", True).grammar is None
    xml = StructuredOutputsParams(grammar=plan_tool_choice(
        [strict_tool], "auto", True, "qwen3_xml", True).grammar)
    xml_call = "<tool_call>\n<function=f>\n<parameter=a>\n{}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(compiler, xml, "Checking. " + xml_call.format(7))
    assert not accepts(compiler, xml, "Checking. " + xml_call.format("seven"))
