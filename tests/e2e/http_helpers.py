"""What the HTTP end-to-end tests share: a chat template with tools for the tiny tokenizer (it
has none of its own), a tool, the gRPC twin of a greedy or seeded HTTP request, and a probe
timing `/health` while the server works."""

from __future__ import annotations

import threading
import time
from typing import Self

import requests

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


class HealthProbe:
    """Times `GET /health` on a connection of its own, from a thread of its own, for as long
    as the `with` block runs: what a load balancer sees while the server works."""

    def __init__(self, base_url: str, interval_s: float = 0.02) -> None:
        self.url, self.interval_s = f"{base_url}/health", interval_s
        self.latencies_s: list[float] = []
        self.statuses: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        with requests.Session() as session:
            while not self._stop.is_set():
                start = time.monotonic()
                self.statuses.add(session.get(self.url, timeout=60).status_code)
                self.latencies_s.append(time.monotonic() - start)
                self._stop.wait(self.interval_s)

    def quantile_s(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> str:
        return (f"/health: {len(self.latencies_s)} probes, p50 {self.quantile_s(0.5) * 1e3:.1f} "
                f"ms, p99 {self.quantile_s(0.99) * 1e3:.1f} ms, max "
                f"{max(self.latencies_s) * 1e3:.1f} ms")

AGENT_MODEL_NAME = "tiny-agent"
AGENT_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content if m.content is string else '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A hermes-style template for the tiny model of `agent_server` (it has none of its own)."""
