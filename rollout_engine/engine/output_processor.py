"""The `n` sampled requests of each prompt, and the RequestOutputs made from them.

Per step, the work done here is proportional to what the step produced: the prompts that got
tokens are found from the step's updated requests, and a prompt's output copies only what its
output kind asks for (nothing until it finishes for FINAL_ONLY, the new tokens for DELTA).
Only CUMULATIVE outputs copy every token so far, at every step. What a stream's consumer was
handed already is known here and only here: a DELTA output has the samples with news, each
finish once, the prompt logprobs and the prompt's routed experts once, and the routed experts
read since the previous output. Text likewise: a DELTA output decodes its new tokens, any other
a sample's text once it finished (rollout_engine.engine.detokenizer).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rollout_engine.core.request import Request
from rollout_engine.engine.request_stats import RequestStats
from rollout_engine.protocol import (
    CompletionOutput,
    RequestOutput,
    RequestOutputKind,
    RoutedExperts,
    SamplingMask,
    TopLogprobs,
)

if TYPE_CHECKING:
    from rollout_engine.engine.detokenizer import CompletionText


@dataclass
class RequestGroup:
    """One prompt and its `n` sampled requests (a GRPO group)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_sent_tokens: list[int] = field(default_factory=list)
    """Streams (DELTA kinds): per sample, how many of its tokens earlier outputs carried."""
    num_sent_logprobs: list[int] = field(default_factory=list)
    sent_finished: list[bool] = field(default_factory=list)
    """Per sample, whether an earlier output already reported it finished."""
    sent_prompt_logprobs: bool = False
    """Streams: whether an earlier output carried the prompt logprobs."""
    num_sent_routed_rows: list[int] = field(default_factory=list)
    """Streams, with routed experts: per sample, how many of its rows earlier outputs carried."""
    sent_prompt_routed_experts: bool = False
    texts: list[CompletionText | None] = field(default_factory=list)
    """Per sample, its text (None: not decoded)."""

    @property
    def is_finished(self) -> bool:
        return all(child.is_finished for child in self.children)


class OutputProcessor:
    """Tracks every unfinished prompt until its final RequestOutput has been handed out.

    Invariant: a group is here while one of its requests is in the scheduler, or while its
    final output (after an abort) has not been handed out yet.
    """

    def __init__(self, stats: RequestStats | None = None) -> None:
        self.stats = stats if stats is not None else RequestStats()
        """Per-request timings and token counts, recorded as outputs are made."""
        self._groups: dict[str, RequestGroup] = {}
        self._group_of: dict[str, str] = {}  # child request id -> group request id
        self._aborted: dict[str, None] = {}  # groups whose final output is owed, in order
        self.num_token_ids_copied = 0
        """Token ids copied into outputs since start: the host work outputs cost."""
        self.num_finished_tokens = 0
        """Output tokens of the completions that finished since start."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def group_ids(self) -> list[str]:
        """Unfinished prompts, in arrival order."""
        return list(self._groups)

    def add(self, group: RequestGroup) -> None:
        num_children = len(group.children)
        group.num_sent_tokens = [0] * num_children
        group.num_sent_logprobs = [0] * num_children
        group.sent_finished = [False] * num_children
        group.num_sent_routed_rows = [0] * num_children
        self._groups[group.request_id] = group
        self._group_of.update((child.request_id, group.request_id) for child in group.children)
        self.stats.on_added(group.children)

    def output_kind(self, group_id: str) -> RequestOutputKind:
        return self._groups[group_id].output_kind

    def streams(self, request_id: str) -> bool:
        """Whether a (child) request's outputs are streamed: each carries only what is new."""
        return self._groups[self._group_of[request_id]].output_kind in _STREAMED

    def children_of(self, group_ids: Iterable[str]) -> list[str]:
        return [c.request_id for gid in group_ids if gid in self._groups
                for c in self._groups[gid].children]

    def group_ids_of(self, child_ids: Iterable[str]) -> list[str]:
        """The groups of these requests, each once, in order."""
        return list(dict.fromkeys(self._group_of[c] for c in child_ids if c in self._group_of))

    @property
    def owes_outputs(self) -> bool:
        """Aborted prompts whose final output the next `outputs()` hands out."""
        return bool(self._aborted)

    def num_generating(self) -> int:
        """Prompts with a request still generating (not finished, not aborted)."""
        return sum(not g.is_finished for g in self._groups.values())

    def mark_aborted(self, group_ids: Iterable[str]) -> None:
        """Owe these groups a final output at the next `outputs()`."""
        self._aborted.update((gid, None) for gid in group_ids if gid in self._groups)

    def outputs(self, updated: Iterable[Request], weight_version: int) -> list[RequestOutput]:
        """Outputs of the prompts whose requests got tokens or finished, then of aborted ones
        (FINAL_ONLY prompts only once all their samples finished).

        A prompt's output is final once all its requests finished; it is then forgotten.
        """
        updated = list(updated)
        self.stats.on_tokens(updated)
        group_ids = dict.fromkeys(self._group_of[r.request_id] for r in updated)
        group_ids.update(self._aborted)
        self._aborted.clear()
        outputs = []
        for gid in group_ids:
            group = self._groups.get(gid)
            if group is None or (
                group.output_kind is RequestOutputKind.FINAL_ONLY and not group.is_finished
            ):
                continue
            outputs.append(self._output(group, weight_version))
        return outputs

    def final_outputs(self, group_ids: Iterable[str], weight_version: int) -> list[RequestOutput]:
        """Outputs of finished groups now (not at the next `outputs()`), in the order given."""
        group_ids = [gid for gid in group_ids if gid in self._groups]
        for gid in group_ids:
            self._aborted.pop(gid, None)
        return [self._output(self._groups[gid], weight_version) for gid in group_ids]

    def _output(self, group: RequestGroup, weight_version: int) -> RequestOutput:
        samples = range(len(group.children))
        prompt_finished = None
        if group.output_kind in _STREAMED:
            samples = [j for j in samples if self._has_news(group, j)]
            prompt_finished = group.is_finished
        outputs = [self._completion(group, j, weight_version) for j in samples]
        output = RequestOutput(group.request_id, group.prompt_token_ids, outputs, group.prompt,
                               self._prompt_logprobs(group), prompt_finished,
                               group.children[0].num_cached_tokens)
        output.prompt_routed_experts = self._prompt_routed_experts(group)
        if output.finished:
            self.stats.on_finished(group.children)
            del self._groups[group.request_id]
            for child in group.children:
                del self._group_of[child.request_id]
        return output

    @staticmethod
    def _has_news(group: RequestGroup, j: int) -> bool:
        """Whether sample j has tokens, or a finish, that no earlier output carried."""
        request = group.children[j]
        return (request.num_output_tokens > group.num_sent_tokens[j]
                or len(request.output_logprobs) > group.num_sent_logprobs[j]
                or request.is_finished and not group.sent_finished[j])

    @staticmethod
    def _prompt_logprobs(group: RequestGroup) -> list[TopLogprobs | None] | None:
        """The prompt's logprobs (sample 0 computes them) once all landed: in every output
        but a stream's, which carry them once."""
        first = group.children[0]
        if first.prompt_logprobs is None or first.num_prompt_logprobs_missing:
            return None
        if group.output_kind in _STREAMED:
            if group.sent_prompt_logprobs:
                return None
            group.sent_prompt_logprobs = True
        return list(first.prompt_logprobs)

    @staticmethod
    def _prompt_routed_experts(group: RequestGroup) -> RoutedExperts | None:
        """The prompt's routing (the same in every sample) once a sample read it: in every
        output but a stream's, which carry it once, with the first tokens."""
        streamed = group.output_kind in _STREAMED
        if streamed and group.sent_prompt_routed_experts:
            return None
        num_prompt_tokens = len(group.prompt_token_ids)
        rows = next((c.routed_experts for c in group.children if c.routed_experts is not None
                     and c.routed_experts.num_rows >= num_prompt_tokens), None)
        if rows is None:
            return None
        group.sent_prompt_routed_experts = streamed
        return RoutedExperts.of(rows.view(0, num_prompt_tokens))

    @staticmethod
    def _routed_experts(group: RequestGroup, j: int) -> RoutedExperts | None:
        """Sample j's output rows in this output: for streams those no earlier output carried
        (DELTA_THEN_WHOLE: all, once it finished), else all (read once it finished). Rows lag
        tokens by one: a token's row is read once the token after it is sampled."""
        request = group.children[j]
        rows = request.routed_experts
        if rows is None:
            return None
        start = request.num_prompt_tokens
        if group.output_kind in _STREAMED:
            first_unsent = max(start, group.num_sent_routed_rows[j])
            group.num_sent_routed_rows[j] = rows.num_rows
            if not (group.output_kind is RequestOutputKind.DELTA_THEN_WHOLE
                    and request.is_finished):
                start = first_unsent
        return RoutedExperts.of(rows.view(start))

    def _completion(self, group: RequestGroup, j: int, weight_version: int) -> CompletionOutput:
        request = group.children[j]
        if request.is_finished and not group.sent_finished[j]:
            self.num_finished_tokens += request.num_output_tokens
        group.sent_finished[j] = request.is_finished
        first_token, first_logprob = self._first_unsent(group, j)
        token_ids = request.output_token_ids[first_token:]
        self.num_token_ids_copied += len(token_ids)
        params = request.sampling_params
        return CompletionOutput(
            index=request.sample_index,
            token_ids=token_ids,
            logprobs=request.output_logprobs[first_logprob:],
            finish_reason=request.finish_reason,
            text=self._text(group, j),
            weight_version=weight_version,
            kv_transfer_params=request.kv_transfer_handle,
            top_logprobs=(request.output_top_logprobs[first_token:]
                          if params.logprobs is not None else None),
            sampling_mask=(SamplingMask.of(request.output_sampling_masks[first_token:])
                           if params.return_sampling_mask else None),
            stop_str=request.stop_str,
            stop_token_id=request.stop_token_id,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_draft_tokens=request.num_accepted_draft_tokens,
            routed_experts=self._routed_experts(group, j),
            # Copies: the request's last span grows after this output is handed out.
            weight_versions=[replace(span) for span in request.weight_versions],
        )

    @staticmethod
    def _first_unsent(group: RequestGroup, j: int) -> tuple[int, int]:
        """(first token, first logprob) of sample j that this output carries: for streams,
        those no earlier output carried (DELTA_THEN_WHOLE: all, once it finished); 0 else."""
        if group.output_kind not in _STREAMED:
            return 0, 0
        request = group.children[j]
        first = (group.num_sent_tokens[j], group.num_sent_logprobs[j])
        group.num_sent_tokens[j] = request.num_output_tokens
        group.num_sent_logprobs[j] = len(request.output_logprobs)
        if group.output_kind is RequestOutputKind.DELTA_THEN_WHOLE and request.is_finished:
            return 0, 0
        return first

    @staticmethod
    def _text(group: RequestGroup, j: int) -> str:
        """Sample j's text in this output: for DELTA the text new since its previous output,
        else all of it once it finished (decoded then, once)."""
        request = group.children[j]
        completion_text = group.texts[j] if group.texts else None
        if completion_text is None or not request.sampling_params.detokenize:
            return ""
        if group.output_kind is RequestOutputKind.DELTA:
            return completion_text.delta(request.output_token_ids, request.is_finished,
                                         request.ended_by_stop_token)
        if not request.is_finished:
            return ""
        return completion_text.final(request.output_token_ids, request.ended_by_stop_token)


_STREAMED = frozenset({RequestOutputKind.DELTA, RequestOutputKind.DELTA_THEN_WHOLE})
"""The kinds whose outputs carry only what earlier outputs of the prompt did not."""
