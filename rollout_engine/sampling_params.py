"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_engine.errors import InvalidRequestError

# Temperatures below this are treated as greedy decoding.
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM's names and defaults)."""

    n: int = 1
    """Number of completions per prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in prompt or output (Hugging Face's rule)."""
    max_tokens: int = 16
    """Maximum number of generated tokens per completion."""
    seed: int | None = None
    """Seed of this request's own random stream; None uses the engine's stream."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a completion (kept in the output, finish reason "stop")."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    detokenize: bool = True
    """Fill `CompletionOutput.text` when a completion finishes."""

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids)
        self._check(isinstance(self.n, int) and self.n >= 1, f"n must be >= 1, got {self.n!r}")
        self._check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be >= 1, got {self.max_tokens!r}",
        )
        self._check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        self._check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        self._check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (off) or >= 1, got {self.top_k!r}",
        )
        self._check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        self._check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        self._check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}",
        )

    @staticmethod
    def _check(ok: bool, message: str) -> None:
        if not ok:
            raise InvalidRequestError(f"invalid SamplingParams: {message}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON
