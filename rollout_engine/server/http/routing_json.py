"""`routed_experts` in the JSON answers, as `vllm serve --enable-return-routed-experts` (vLLM
0.32) sends it.

Unstreamed, as vLLM: each choice of `/v1/completions` and `/v1/chat/completions` has
`routed_experts`, a base64-encoded `.npy` file (`np.save`) of [rows, MoE layers, top_k]: the
experts of the prompt's tokens from `routed_experts_prompt_start` (the request's, default 0) on,
then of the output's, all but the last sampled token (never read: vLLM's `num_tokens - 1`); null
without routing. `np.load(io.BytesIO(base64.b64decode(s)))` reads it (int16 here; vLLM's dtype
may differ, the file names it). vLLM has no response-level prompt part: the prompt's rows lead
every choice's array.

Streamed (vLLM returns routing unstreamed only): a chunk's choice carries `routed_experts`, the
same encoding, with the rows new since that choice's previous chunk; the first ones start with
the prompt's rows (a chat stream's role chunk carries them alone), so a choice's chunks
concatenated give the unstreamed value. A chunk without new rows leaves the field out.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Hashable

import numpy as np

from rollout_engine.protocol import RequestOutput, RoutedExperts


def encode(rows: np.ndarray) -> str:
    """Rows as a base64-encoded `.npy` file (vLLM's `numpy2base64`)."""
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _rows(prompt: RoutedExperts | None, output: RoutedExperts | None, prompt_start: int
          ) -> np.ndarray | None:
    parts = [part for part in (None if prompt is None else prompt.to_numpy()[prompt_start:],
                               None if output is None else output.to_numpy())
             if part is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def choice_routed_experts(output: RequestOutput, completion_rows: RoutedExperts | None,
                          prompt_start: int) -> str | None:
    """An unstreamed choice's `routed_experts`: None (null) if the engine returned none."""
    if completion_rows is None:
        return None
    return encode(_rows(output.prompt_routed_experts, completion_rows, prompt_start))


class StreamedRouting:
    """The `routed_experts` of a stream's chunks: the prompt's rows (from its first output) go
    with a choice's first rows, then each chunk has its completion's new rows."""

    def __init__(self, prompt_start: int) -> None:
        self.prompt_start = prompt_start
        self.prompt_rows: dict[int, RoutedExperts] = {}
        """Per prompt (its index in the request), its rows, once its first output had them."""
        self.started: set[Hashable] = set()
        """The choices whose chunks carried the prompt's rows."""

    def see(self, prompt_index: int, output: RequestOutput) -> None:
        if output.prompt_routed_experts is not None:
            self.prompt_rows[prompt_index] = output.prompt_routed_experts

    def add(self, choice: dict, prompt_index: int, key: Hashable,
            rows: RoutedExperts | None) -> None:
        """Set `choice["routed_experts"]` to its new rows (none: left out)."""
        prompt = None
        if key not in self.started and prompt_index in self.prompt_rows:
            prompt = self.prompt_rows[prompt_index]
            self.started.add(key)
        new = _rows(prompt, rows, self.prompt_start)
        if new is not None and len(new):
            choice["routed_experts"] = encode(new)
