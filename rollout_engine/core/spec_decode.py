"""Speculative decoding bookkeeping: who drafts this step, how many, and how it went. No torch.

The n-gram proposer suggests drafts; this module decides when drafting is worth it
(off above a batch size, off for a request whose drafts keep being rejected), caps
drafts by what the request may still generate, and keeps the acceptance counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout_engine.config import SpeculativeConfig
from rollout_engine.core.ngram_proposer import NgramProposer
from rollout_engine.core.request import Request
from rollout_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

# A request stops drafting once this many of its drafts were verified and fewer than
# MIN_ACCEPTANCE_RATE of them were accepted: its text does not repeat.
MIN_DRAFTS_TO_JUDGE = 16
MIN_ACCEPTANCE_RATE = 0.2


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
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass
class _RequestRecord:
    num_drafts: int = 0
    num_accepted: int = 0


@dataclass
class SpecDecoder:
    """Proposes drafts for the running requests and records how many were accepted."""

    config: SpeculativeConfig
    max_model_len: int
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def __post_init__(self) -> None:
        self.proposer = NgramProposer(self.config)
        self._records: dict[str, _RequestRecord] = {}

    def record(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Count verified and accepted drafts of the step that just ran."""
        for request_id in scheduler_output.finished_request_ids:
            self._records.pop(request_id, None)
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            sampled = runner_output.sampled_token_ids.get(request_id)
            if not sampled:
                continue
            num_accepted = len(sampled) - 1
            record = self._records.setdefault(request_id, _RequestRecord())
            record.num_drafts += len(drafts)
            record.num_accepted += num_accepted
            self.stats.num_drafts += len(drafts)
            self.stats.num_accepted_tokens += num_accepted
            self.stats.num_draft_steps += 1

    def propose(self, requests: Sequence[Request], num_running: int) -> dict[str, list[int]]:
        """Drafts for the next step, by request id, for the decoding `requests` that should
        draft; the scheduler takes them (`update_draft_token_ids`). Reads requests only."""
        if num_running > self.config.disable_by_batch_size:
            self.stats.num_disabled_steps += 1
            return {}
        drafts: dict[str, list[int]] = {}
        for request in requests:
            if not self._is_worth(request):
                continue  # drafting does not pay for this request
            max_num_tokens = min(
                self.config.num_speculative_tokens,
                # The target adds one token after the drafts; never draft past the end.
                request.sampling_params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if max_num_tokens > 0:
                proposal = self.proposer.propose(request.all_token_ids, max_num_tokens)
                if proposal:
                    drafts[request.request_id] = proposal
        return drafts

    def _is_worth(self, request: Request) -> bool:
        record = self._records.get(request.request_id)
        if record is None or record.num_drafts < MIN_DRAFTS_TO_JUDGE:
            return True
        return record.num_accepted >= MIN_ACCEPTANCE_RATE * record.num_drafts
