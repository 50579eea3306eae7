"""Speculative decoding bookkeeping: who drafts this step, how many, and how it went. No torch.

The proposer (n-gram, or suffix: `SpeculativeConfig.method`) suggests drafts; this module
decides when drafting is worth it (off for a request whose drafts keep being rejected; above
`disable_by_batch_size` running requests, off for n-gram and, for suffix drafting, kept for
the requests whose prompts' drafts are mostly accepted and for as many others as that budget
leaves room for, those whose prompts' earlier completions say they will run longest), caps
drafts by what the request may still generate, hands finished completions and acceptance
counts to the suffix proposer, and keeps the engine's acceptance counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout_engine.config import SpeculativeConfig
from rollout_engine.core.ngram_proposer import NgramProposer
from rollout_engine.core.request import Request
from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from rollout_engine.core.suffix_proposer import SuffixProposer

# A request stops drafting once this many of its drafts were verified and fewer than
# MIN_ACCEPTANCE_RATE of them were accepted: its text does not repeat.
MIN_DRAFTS_TO_JUDGE = 16
MIN_ACCEPTANCE_RATE = 0.2
# Suffix drafting above `disable_by_batch_size`: a request whose prompt's drafts are accepted
# this often drafts whatever the batch (little of what it verifies is wasted).
HIGH_ACCEPTANCE_RATE = 0.7
# Suffix drafting: a request whose proposals keep finding nothing waits one more step after
# each empty one before the next, up to this many (a search costs tens of microseconds).
MAX_MISS_WAIT = 8


@dataclass
class SpecDecodeStats:
    """Counters over the engine's lifetime."""

    num_drafts: int = 0
    """Draft tokens verified by the target model."""
    num_accepted_tokens: int = 0
    """Draft tokens the target model accepted."""
    num_draft_steps: int = 0
    """(request, step) pairs that verified at least one draft."""
    num_disabled_steps: int = 0
    """Steps in which drafting was off because the batch was too large."""
    num_budgeted_steps: int = 0
    """Suffix drafting: steps with more candidates than `disable_by_batch_size`, where the
    sure ones and those expected to run longest drafted (see `_within_budget`)."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per drafting step: accepted drafts plus the target's own token."""
        if not self.num_draft_steps:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_draft_steps

    def as_dict(self) -> dict[str, float]:
        return {
            "num_drafts": self.num_drafts,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_draft_steps": self.num_draft_steps,
            "num_disabled_steps": self.num_disabled_steps,
            "num_budgeted_steps": self.num_budgeted_steps,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass
class _Misses:
    """Suffix drafting: a request's proposals that found nothing (its verified and accepted
    drafts the request counts itself: `num_draft_tokens`, `num_accepted_draft_tokens`)."""

    num_misses: int = 0
    """Proposals in a row that found nothing."""
    wait: int = 0
    """Steps to let pass before proposing again."""


@dataclass
class SpecDecoder:
    """Proposes drafts for the running requests and records how many were accepted."""

    config: SpeculativeConfig
    max_model_len: int
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def __post_init__(self) -> None:
        self.suffix = SuffixProposer(self.config) if self.config.method == "suffix" else None
        self.ngram = NgramProposer(self.config) if self.suffix is None else None
        self._misses: dict[str, _Misses] = {}

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
               updated: Sequence[Request] = ()) -> None:
        """Count verified and accepted drafts of the step that just ran; remember the
        completions it finished (suffix drafting)."""
        for request_id in scheduler_output.finished_request_ids:
            self._misses.pop(request_id, None)
            if self.suffix is not None:
                self.suffix.forget_request(request_id)
        if self.suffix is not None:
            for request in updated:
                if request.is_finished and request.finish_reason in ("stop", "length"):
                    self.suffix.add_completion(request)
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            sampled = runner_output.sampled_token_ids.get(request_id)
            if not sampled:
                continue
            num_accepted = len(sampled) - 1
            self.stats.num_drafts += len(drafts)
            self.stats.num_accepted_tokens += num_accepted
            self.stats.num_draft_steps += 1
            if self.suffix is not None:
                self.suffix.record(request_id, len(drafts), num_accepted)

    def propose(self, requests: Sequence[Request], num_running: int) -> dict[str, list[int]]:
        """Drafts for the next step, by request id, for the decoding `requests` that should
        draft; the scheduler takes them (`update_draft_token_ids`). Reads requests only."""
        budget = self.config.disable_by_batch_size
        if num_running > budget and self.suffix is None:
            self.stats.num_disabled_steps += 1
            return {}
        # Drafting does not pay for some (their drafts are rejected); others wait after a miss.
        requests = [r for r in requests if self._is_worth(r) and self._is_due(r)]
        if len(requests) > budget:
            requests = self._within_budget(requests, budget)
            self.stats.num_budgeted_steps += 1
        drafts: dict[str, list[int]] = {}
        for request in requests:
            max_num_tokens = min(
                self.config.num_speculative_tokens,
                # The target adds one token after the drafts; never draft past the end.
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if max_num_tokens <= 0:
                continue
            if self.ngram is not None:
                proposal = self.ngram.propose(request.all_token_ids, max_num_tokens)
            else:
                proposal = self._propose_suffix(request, max_num_tokens)
            if proposal:
                drafts[request.request_id] = proposal
        return drafts

    def _is_due(self, request: Request) -> bool:
        misses = self._misses.get(request.request_id)
        if misses is None or not misses.wait:
            return True
        misses.wait -= 1
        return False

    def _propose_suffix(self, request: Request, max_num_tokens: int) -> list[int]:
        misses = self._misses.setdefault(request.request_id, _Misses())
        proposal = self.suffix.propose(request, max_num_tokens)
        misses.num_misses = 0 if proposal else misses.num_misses + 1
        misses.wait = min(misses.num_misses, MAX_MISS_WAIT)
        return proposal

    def reset_history(self) -> None:
        """Drop the earlier completions suffix drafting drafts from (they hold tokens, not
        weights: nothing requires it after a weight update)."""
        if self.suffix is not None:
            self.suffix.reset()

    def _within_budget(self, requests: list[Request], budget: int) -> list[Request]:
        """Suffix drafting in a batch larger than `budget`: the requests whose prompts' drafts
        are mostly accepted, and of the others as many as the budget has room for, those
        expected to run longest first (the tail that sets the step's makespan)."""
        assert self.suffix is not None
        sure, others = [], []
        for request in requests:
            rate = self.suffix.acceptance(request)
            (sure if rate is not None and rate >= HIGH_ACCEPTANCE_RATE else others).append(request)
        room = max(0, budget - len(sure))
        return sure + sorted(others, key=self._expected_remaining, reverse=True)[:room]

    def _expected_remaining(self, request: Request) -> float:
        remaining = self.suffix.expected_remaining(request)
        return float("inf") if remaining is None else remaining

    @staticmethod
    def _is_worth(request: Request) -> bool:
        if request.num_draft_tokens < MIN_DRAFTS_TO_JUDGE:
            return True
        return request.num_accepted_draft_tokens >= MIN_ACCEPTANCE_RATE * request.num_draft_tokens
