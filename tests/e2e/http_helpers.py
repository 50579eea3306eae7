"""What the HTTP end-to-end tests share: a chat template with tools for the tiny tokenizer (it
has none of its own), a tool, and the gRPC twin of a greedy or seeded HTTP request."""

from __future__ import annotations

from trainer_bridge import SamplingParams

CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call: {% for tool in tools %}{{ tool.function.name }}"
    "({{ tool.function.parameters.properties | list | join(', ') }}) {% endfor %}\n{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Renders `tools` into the prompt, as the templates of tool-calling models do."""


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city to get the weather for.
        unit: The temperature unit, "celsius" or "fahrenheit".
    """
    return f"22 degrees {unit} in {city}"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the weather in Paris?"}]


def grpc_params(**fields) -> SamplingParams:
    """The EngineClient twin of an HTTP request's sampling fields, EOS ignored (the tiny
    random model emits it anywhere)."""
    return SamplingParams(ignore_eos=True, **fields)
