"""`LLM.chat` (vLLM's offline chat): conversations rendered as `serve` renders them, and with
vLLM's parser names each completion's parsed message beside its raw tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from rollout_engine import LLM, SamplingParams
from rollout_engine.protocol import StructuredOutputsParams

TEMPLATE = ("{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}"
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
"""Opens the reasoning block in the prompt, as thinking templates do."""
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}]
ANSWER = ('Plan: search.</think>\n\n<tool_call>\n{"name": "search", "arguments": {"query": '
          '"café"}}\n</tool_call>')


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), kv_cache_bytes=8 << 20, max_model_len=256)


def forced(text: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120,
                          structured_outputs=StructuredOutputsParams(choice=[text]))


def test_chat_parses_reasoning_and_calls_beside_the_raw_tokens(llm, llama_dir):
    conversation = [{"role": "user", "content": "find cafés"}]
    (output,) = llm.chat(conversation, forced(ANSWER), chat_template=TEMPLATE, tools=TOOLS,
                         tool_parser="hermes", reasoning_parser="qwen3",
                         enable_in_reasoning=True)  # the forced text holds the reasoning
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    expected_prompt = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True,
        tokenize=False)
    assert output.prompt_token_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    (completion,) = output.outputs
    assert completion.text == ANSWER and tokenizer.decode(completion.token_ids[:-1]) == ANSWER
    message = completion.message
    assert message.reasoning == "Plan: search." and message.content is None
    (call,) = message.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("search", {"query": "café"})


def test_chat_without_parsers_is_vllms_plain_chat(llm):
    conversations = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    outputs = llm.chat(conversations, forced("Plain."), chat_template=TEMPLATE)
    assert [o.outputs[0].text for o in outputs] == ["Plain.", "Plain."]
    assert outputs[0].outputs[0].message is None
    assert outputs[0].prompt_token_ids != outputs[1].prompt_token_ids


def test_unknown_parsers_and_bad_conversations_are_refused(llm):
    with pytest.raises(ValueError, match="hermes"):
        llm.chat([{"role": "user", "content": "a"}], chat_template=TEMPLATE, tool_parser="x")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat([{"role": "user", "content": "a"}], chat_template=TEMPLATE,
                 continue_final_message=True)


CONSTRAINED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "when": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                 "maximum": 23}},
                     "required": ["hour"], "additionalProperties": False}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
        "required": ["query"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("tool_parser", ["hermes", "llama3_json", "qwen3_xml"])
def test_required_calls_of_a_random_model_parse_and_validate_in_each_format(llm, tool_parser):
    """`LLM.chat(tool_choice="required")` writes the parser's own format: 64 samples at
    temperature 1, every one a call that parses back and whose arguments match its schema."""
    params = SamplingParams(n=64, temperature=1.0, seed=1, max_tokens=200)
    (output,) = llm.chat([{"role": "user", "content": "go"}], params, chat_template=TEMPLATE,
                         tools=CONSTRAINED_TOOLS, tool_parser=tool_parser,
                         tool_choice="required", parallel_tool_calls=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CONSTRAINED_TOOLS}
    names = set()
    for completion in output.outputs:
        assert completion.finish_reason == "stop", completion.text
        (call,) = completion.message.tool_calls
        assert completion.message.content is None, completion.text
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        names.add(call.name)
    assert names == {"get_weather", "search"}


def test_chat_token_in_extends_the_previous_turn(llm):
    """`LLM.chat(tokens=...)`: the next turn's prompt is the previous prompt and completion ids
    as sampled, then the new messages' tokens; a conversation that does not extend them is
    refused."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=10,
                            allowed_token_ids=list(range(2, 512)))
    template = TEMPLATE.replace("<think>\n", "")  # TEMPLATE opens a block history never shows
    turn = [{"role": "user", "content": "first"}]
    (first,) = llm.chat(turn, params, chat_template=template)
    sampled = first.outputs[0]
    history = first.prompt_token_ids + sampled.token_ids
    turn = [*turn, {"role": "assistant", "content": sampled.text},
            {"role": "user", "content": "second"}]
    (second,) = llm.chat(turn, params, chat_template=template, tokens=history)
    assert second.prompt_token_ids[:len(history)] == history
    assert len(second.prompt_token_ids) > len(history)
    with pytest.raises(ValueError, match="not how the chat template ends"):
        llm.chat(turn, params, chat_template=template, tokens=[5, 6, 7])


def test_token_in_bridges_a_template_that_renders_the_answer_its_own_way(llm, llama_dir):
    """The template trims the answer, so the conversation's text does not extend the sampled
    tokens: the new tokens are what it renders after the answer's end-of-turn token (EOS, as
    Qwen's `<|im_end|>`), and the prompt keeps the sampled ids. A template that renders the
    answer without the end-of-turn token the model sampled cannot be bridged."""
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ eos_token }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    turn = [{"role": "user", "content": "first"}]
    (first,) = llm.chat(turn, forced("  spaced answer  "), chat_template=template)
    sampled = first.outputs[0]
    assert sampled.token_ids[-1] == tokenizer.eos_token_id  # the choice ended, then EOS
    history = first.prompt_token_ids + sampled.token_ids
    turn = [*turn, {"role": "assistant", "content": sampled.text},
            {"role": "user", "content": "second"}]
    params = SamplingParams(max_tokens=2)
    (second,) = llm.chat(turn, params, chat_template=template, tokens=history)
    assert second.prompt_token_ids[:len(history)] == history
    new_text = f"\n<|user|>second{tokenizer.eos_token}\n<|assistant|>"
    assert second.prompt_token_ids[len(history):] == tokenizer.encode(
        new_text, add_special_tokens=False)
    (rendered,) = llm.chat(turn, params, chat_template=template)  # the control: re-rendered
    assert rendered.prompt_token_ids[:len(history)] != history
    without_eos = template.replace("{{ eos_token }}", "")
    with pytest.raises(ValueError, match="not how the chat template ends"):
        llm.chat(turn, params, chat_template=without_eos, tokens=history)
    rewriting = template.replace("{{ m.content | trim }}",
                                 "{{ m.content if loop.last else 'earlier' }}")
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        llm.chat(turn, params, chat_template=rewriting, tokens=history)
