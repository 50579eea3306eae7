"""Reasoning parsers (vLLM's `--reasoning-parser` names): the text inside `<think> ...
</think>` becomes `message.reasoning`, the rest is the answer.

Where reasoning starts:
- `deepseek_r1`: the template opens the block in the prompt, so the output starts inside it
  (a leading `<think>` in the output is dropped too); without `</think>` all of it is
  reasoning, as in vLLM.
- `qwen3`: inside the block if the prompt ends with an open `<think>` (thinking templates) or
  the output starts with `<think>`; otherwise the output is all answer (`enable_thinking=False`
  renders a closed, empty block in the prompt). A block the output never closes is reasoning
  (vLLM calls it content when not streaming, and cannot decide while streaming; a truncated
  thought is still a thought).
Tool calls written inside reasoning stay there, verbatim (vLLM's rule: calls come from the
content only): nothing is lost, and a trainer sees the call in the reasoning text it sampled.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from rollout_engine.parsing.messages import MessageDelta
from rollout_engine.parsing.scanner import cut_before

State = Literal["start", "reasoning", "content"]


class ReasoningParser:
    """One completion's reasoning split, fed its text piece by piece."""

    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    without_start_marker: ClassVar[State]
    """What an output is that does not begin with `<think>` (and whose prompt did not open one)."""

    def __init__(self, prompt_text: str = "") -> None:
        self._state: State = "reasoning" if self.prompt_opens_block(prompt_text) else "start"
        self._held = ""

    def prompt_opens_block(self, prompt_text: str) -> bool:
        _, marker, tail = prompt_text.rpartition(self.start_marker)
        return bool(marker) and self.end_marker not in tail

    def feed(self, text: str) -> MessageDelta:
        delta, buffer = MessageDelta(), self._held + text
        self._held = ""
        if self._state == "start":
            buffer = self._leave_start(buffer)
            if self._state == "start":
                self._held = buffer
                return delta
        if self._state == "reasoning":
            delta.reasoning, buffer, found = cut_before(buffer, self.end_marker)
            if not found:
                self._held = buffer
                return delta
            self._state = "content"
        delta.content = buffer
        return delta

    def finish(self) -> MessageDelta:
        held, self._held = self._held, ""
        state = self.without_start_marker if self._state == "start" else self._state
        if self._state == "start" and state == "reasoning":
            held = held.lstrip()  # only whitespace, or a cut-off "<thi"
        return MessageDelta(reasoning=held) if state == "reasoning" else MessageDelta(held)

    def _leave_start(self, buffer: str) -> str:
        """Decide from the output's first characters whether it opens a block; the buffer
        with the marker taken off (or unchanged while undecided)."""
        stripped = buffer.lstrip()
        if stripped.startswith(self.start_marker):
            self._state = "reasoning"
            return stripped[len(self.start_marker):]
        if not stripped or self.start_marker.startswith(stripped):
            return buffer  # undecided: whitespace, or the beginning of "<think>"
        self._state = self.without_start_marker
        return buffer


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    without_start_marker = "content"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    without_start_marker = "reasoning"

    def prompt_opens_block(self, prompt_text: str) -> bool:
        # R1's template opens the block in the prompt; an output that opens it again has its
        # "<think>" dropped, and one that does not is reasoning anyway (`without_start_marker`).
        return False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}
