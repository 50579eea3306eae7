"""The `n` sampled requests of each prompt, and the RequestOutputs made from them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rollout_engine.core.request import Request
from rollout_engine.protocol import CompletionOutput, RequestOutput


@dataclass
class RequestGroup:
    """One prompt and its `n` sampled requests (a GRPO group)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return all(child.is_finished for child in self.children)


class OutputProcessor:
    """Tracks every unfinished prompt until its final RequestOutput has been handed out.

    Invariant: a group is here while one of its requests is in the scheduler, or while its
    final output (after an abort) has not been handed out yet.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._groups: dict[str, RequestGroup] = {}
        self._group_of: dict[str, str] = {}  # child request id -> group request id
        self._aborted: dict[str, None] = {}  # groups whose final output is owed, in order

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def group_ids(self) -> list[str]:
        """Unfinished prompts, in arrival order."""
        return list(self._groups)

    def add(self, group: RequestGroup) -> None:
        self._groups[group.request_id] = group
        self._group_of.update((child.request_id, group.request_id) for child in group.children)

    def children_of(self, group_ids: Iterable[str]) -> list[str]:
        return [c.request_id for gid in group_ids if gid in self._groups
                for c in self._groups[gid].children]

    def group_ids_of(self, child_ids: Iterable[str]) -> list[str]:
        """The groups of these requests, each once, in order."""
        return list(dict.fromkeys(self._group_of[c] for c in child_ids if c in self._group_of))

    def num_generating(self) -> int:
        """Prompts with a request still generating (not finished, not aborted)."""
        return sum(not g.is_finished for g in self._groups.values())

    def mark_aborted(self, group_ids: Iterable[str]) -> None:
        """Owe these groups a final output at the next `outputs()`."""
        self._aborted.update((gid, None) for gid in group_ids if gid in self._groups)

    def outputs(self, updated: Iterable[Request], weight_version: int) -> list[RequestOutput]:
        """Outputs of the prompts whose requests got tokens or finished, then of aborted ones.

        A prompt's output is final once all its requests finished; it is then forgotten.
        """
        group_ids = dict.fromkeys(self._group_of[r.request_id] for r in updated)
        group_ids.update(self._aborted)
        self._aborted.clear()
        return [self._output(gid, weight_version) for gid in group_ids if gid in self._groups]

    def final_outputs(self, group_ids: Iterable[str], weight_version: int) -> list[RequestOutput]:
        """Outputs of finished groups now (not at the next `outputs()`), in the order given."""
        group_ids = [gid for gid in group_ids if gid in self._groups]
        for gid in group_ids:
            self._aborted.pop(gid, None)
        return [self._output(gid, weight_version) for gid in group_ids]

    def _output(self, group_id: str, weight_version: int) -> RequestOutput:
        group = self._groups[group_id]
        outputs = [self._completion(child, weight_version) for child in group.children]
        output = RequestOutput(group.request_id, group.prompt_token_ids, outputs, group.prompt)
        if output.finished:
            del self._groups[group_id]
            for child in group.children:
                del self._group_of[child.request_id]
        return output

    def _completion(self, request: Request, weight_version: int) -> CompletionOutput:
        text = ""
        if request.is_finished and request.sampling_params.detokenize:
            text = self._decode(request.output_token_ids)
        return CompletionOutput(
            index=request.sample_index,
            token_ids=list(request.output_token_ids),
            logprobs=list(request.output_logprobs),
            finish_reason=request.finish_reason,
            text=text,
            weight_version=weight_version,
            kv_transfer_params=request.kv_transfer_handle,
        )
