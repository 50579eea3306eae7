"""Incremental cutting of generated text at markers (`<think>`, `<tool_call>`, ...): each
piece of text is looked at once, plus a held-back tail shorter than a marker that may be the
marker's beginning, so a stream of n characters is parsed in O(n) whatever its chunking."""

from __future__ import annotations

from typing import Literal

PieceKind = Literal["text", "block"]


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def cut_before(buffer: str, marker: str) -> tuple[str, str, bool]:
    """(text before `marker`, what follows it, True) if `buffer` holds it; else (what is
    surely not part of it, the held-back tail that may begin it, False)."""
    at = buffer.find(marker)
    if at >= 0:
        return buffer[:at], buffer[at + len(marker):], True
    keep = partial_marker_len(buffer, marker)
    return buffer[:len(buffer) - keep], buffer[len(buffer) - keep:], False


class BlockScanner:
    """Cuts a text stream into text outside blocks and the bodies of `start ... end` blocks.

    `feed` returns ("text", s) and ("block", body) pieces in order; `finish` returns what is
    left: held-back text, or ("open", body) for a block the text never closed."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self._held = ""
        self._body: list[str] | None = None  # inside a block: its text so far

    @property
    def is_inside_block(self) -> bool:
        return self._body is not None

    def feed(self, text: str) -> list[tuple[PieceKind, str]]:
        pieces: list[tuple[PieceKind, str]] = []
        buffer = self._held + text
        while True:
            if self._body is None:
                before, buffer, found = cut_before(buffer, self.start)
                if before:
                    pieces.append(("text", before))
                if not found:
                    break
                self._body = []
            else:
                before, buffer, found = cut_before(buffer, self.end)
                self._body.append(before)
                if not found:
                    break
                pieces.append(("block", "".join(self._body)))
                self._body = None
        self._held = buffer
        return pieces

    def finish(self) -> list[tuple[Literal["text", "open"], str]]:
        held, self._held = self._held, ""
        if self._body is not None:
            body, self._body = "".join(self._body) + held, None
            return [("open", body)]
        return [("text", held)] if held else []
