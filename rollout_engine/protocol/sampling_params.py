"""What a request asks for: sampling parameters (vLLM's fields and semantics), structured-output
constraints and KV transfer handles, each validated on construction."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

from rollout_engine.protocol.exceptions import InvalidRequestError

# Temperatures below this are treated as greedy decoding.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
"""The most top logprobs a request may ask for per position (`logprobs`, `prompt_logprobs`;
vLLM's default `max_logprobs`)."""
LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
LOGPROBS_MODES: tuple[str, ...] = ("processed_logprobs", "raw_logprobs")
MAX_LOGIT_BIAS = 100.0
"""`logit_bias` values are clamped to [-100, 100] (OpenAI's range)."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: the sampling kernels see every parameter in float32."""
MIN_REPETITION_PENALTY = 1e-6
"""Smaller repetition penalties are refused: a logit divided by one overflows float32 (1e-50
is 0 there), and the inf makes NaN logprobs."""

@dataclass
class StructuredOutputsParams:
    """A constraint on a completion (vLLM's names): exactly one of the fields is set.

    Once the constraint is complete only EOS may follow (vLLM's rule): the completion ends
    with it, finish reason "stop", the EOS in its token ids and logprobs (not in its text, as
    no stop token is, unless `include_stop_str_in_output`), before `min_tokens` too (which
    yields where the constraint allows only EOS). With `ignore_eos` that EOS ends the
    constraint and the tokens after it are free, as in vLLM.
    """

    json: str | None = None
    """A JSON Schema (a JSON string; a dict is accepted and serialised)."""
    regex: str | None = None
    """The completion matches this regular expression, whole."""
    choice: list[str] | None = None
    """The completion is one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax (llguidance's dialect)."""
    json_object: bool | None = None
    """Any JSON object."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if self.choice is not None:
            self.choice = list(self.choice)
            _check_structured(
                bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                f"choice must be a non-empty list of non-empty strings, got {self.choice!r}",
            )
        constraints = [
            name for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        _check_structured(
            len(constraints) == 1,
            f"set exactly one of json, regex, choice, grammar, json_object; got {constraints}",
        )

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar")
                    if getattr(self, n) is not None)


def _check_structured(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid StructuredOutputsParams: {message}")


KV_TRANSPORTS = ("shm", "grpc", "cuda_ipc")
"""How a prefill engine hands KV to a decode engine: a /dev/shm file on one host, a gRPC
stream from the prefill server (any host), or a CUDA IPC handle (one GPU)."""


@dataclass
class KVTransferParams:
    """Prefill–decode disaggregation (vLLM's `kv_transfer_params`).

    To a prefill engine: `KVTransferParams(do_remote_decode=True)` with `max_tokens=1`; the
    completion comes back with a handle (`CompletionOutput.kv_transfer_params`). To a decode
    engine: that handle, as it is, with the same prompt: the engine loads the prompt's KV
    instead of computing it, and computes it itself if the transfer fails.
    """

    do_remote_decode: bool = False
    """Prefill side: keep this prompt's KV for a decode engine and return a handle."""
    do_remote_prefill: bool = False
    """Decode side: this is a handle; load the KV it names."""
    transfer_id: str = ""
    transport: str = ""
    """One of KV_TRANSPORTS."""
    location: str = ""
    """Where the KV is: the /dev/shm file name, the prefill server's address (grpc), or the
    CUDA IPC handle as JSON."""
    num_tokens: int = 0
    """The leading prompt positions whose KV the handle holds."""
    prompt_hash: str = ""
    """SHA-256 of those positions' token ids: a handle is only used for the same prompt."""
    layout: str = ""
    """The prefill engine's KV layout and model (KVLayout.key): they must match exactly."""
    weight_version: int = 0
    """The weight version that computed the KV: the decode engine's must be the same."""
    weights_fingerprint: str = ""
    """A digest of the weights that computed the KV: the decode engine's must be the same
    (equal versions of two different checkpoints are still refused)."""

    def __post_init__(self) -> None:
        if self.do_remote_decode and self.do_remote_prefill:
            raise InvalidRequestError(
                "kv_transfer_params: set do_remote_decode (to a prefill engine) or "
                "do_remote_prefill (a handle, to a decode engine), not both"
            )
        if self.do_remote_prefill:
            if self.transport not in KV_TRANSPORTS:
                raise InvalidRequestError(
                    f"kv_transfer_params: transport must be one of {KV_TRANSPORTS}, "
                    f"got {self.transport!r}"
                )
            if not self.transfer_id or self.num_tokens < 1:
                raise InvalidRequestError(
                    "kv_transfer_params: a handle needs a transfer_id and num_tokens >= 1 "
                    "(pass the prefill engine's CompletionOutput.kv_transfer_params as it is)"
                )


@dataclass
class SamplingParams:
    """How to sample one prompt's completions (vLLM's names and defaults), validated on
    construction."""

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
    """Fill `CompletionOutput.text`: the output tokens decoded after the prompt (vLLM's
    detokenizer), without the text of a stop token (EOS, `stop_token_ids`) that ended it."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the completions (JSON Schema, regex, choice, grammar); None: free text."""
    kv_transfer_params: KVTransferParams | None = None
    """Prefill–decode disaggregation: save the prompt's KV for a decode engine, or load it
    from a prefill engine's handle (see KVTransferParams)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (a str is taken as one). A stop string may span several
    tokens; the completion's `token_ids` end with the token that completed it, its `text` is
    cut before it (after it with `include_stop_str_in_output`), `finish_reason` is "stop" and
    `stop_reason` the string. Looked for in the new text of each token, once `min_tokens`
    tokens were generated (the first string of the list found wins)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string, or the stop token that ended the completion, in its `text`."""
    min_tokens: int = 0
    """EOS and `stop_token_ids` are masked, and stop strings end nothing, until this many tokens
    were generated."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the completion already holds (OpenAI's rule),
    before temperature; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the completion already holds it; [-2, 2]."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> a value added to its logit before penalties (clamped to [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (None: all)."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated: a word's last token is masked wherever the completion ends with
    its other tokens (each word tokenized alone and after a space, as vLLM does)."""
    logprobs: int | None = None
    """Return the `logprobs` most likely tokens and their logprobs at each generated position
    (`CompletionOutput.top_logprobs`), with the sampled token's always first; 0 returns only the
    sampled token's entry with its rank. At most MAX_LOGPROBS. None: none (the sampled tokens'
    logprobs are in `CompletionOutput.logprobs` always)."""
    logprobs_mode: LogprobsMode = "processed_logprobs"
    """Which distribution every returned logprob (`logprobs` and `top_logprobs`) is of:
    "processed_logprobs", the one the token was sampled from (after masks, bias, penalties,
    temperature, top-k/p, min-p; for greedy rows at temperature 1), or "raw_logprobs", the
    model's own log-softmax."""
    prompt_logprobs: int | None = None
    """Return, for every prompt position but the first, the logprob of the prompt's token there
    and of the `prompt_logprobs` most likely tokens (`RequestOutput.prompt_logprobs`; the raw
    model distribution). At most MAX_LOGPROBS. The prompt is then computed, never read from
    the prefix cache."""
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last k tokens (None: all)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of `text`."""
    spaces_between_special_tokens: bool = True
    """With `skip_special_tokens=False`: False joins special tokens in `text` as they are,
    without a space between them (vLLM's)."""
    kv_keep_alive_s: float = 0.0
    """Multi-turn: once the completion ends (not aborted), keep its cached KV blocks for up
    to this many seconds (capped by the engine's `max_kv_keep_alive_s`) so the conversation's
    next turn, which extends these tokens, finds them even if the cache is busy. The hold ends
    early when that turn arrives, and yields to any request that needs the blocks. 0: none."""
    return_sampling_mask: bool = False
    """Return, per generated token, the ids the sampler's truncation kept
    (`CompletionOutput.sampling_mask`): top-k, top-p, min-p and the masks of
    `allowed_token_ids`, bad words and `structured_outputs`; for greedy rows the argmax alone.
    A trainer renormalises its logprobs over them (`trainer_bridge.masked_logprobs`). Refused
    when nothing truncates."""

    def __post_init__(self) -> None:
        self._check_stop()
        self._check_logits_processing()
        self._check_logprobs()
        self.stop_token_ids = list(self.stop_token_ids)
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be >= 1, got {self.n!r}")
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            f"max_tokens must be >= 1, got {self.max_tokens!r}",
        )
        self._check_filters()
        self._check_sampling_mask()
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}",
        )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams or None",
        )
        _check(
            _is_finite_real(self.kv_keep_alive_s) and self.kv_keep_alive_s >= 0,
            f"kv_keep_alive_s must be a finite number of seconds >= 0, "
            f"got {self.kv_keep_alive_s!r}",
        )
        kv = self.kv_transfer_params
        _check(
            kv is None or isinstance(kv, KVTransferParams),
            "kv_transfer_params must be a KVTransferParams or None",
        )
        _check(
            kv is None or not kv.do_remote_decode or self.n == 1,
            f"a prefill for a remote decode (do_remote_decode) samples n=1, got n={self.n}",
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def any_output_penalty(self) -> bool:
        """A penalty that reads the tokens generated so far (presence, frequency)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _check_filters(self) -> None:
        """Temperature, top-k/p, min-p and the repetition penalty, as the float32 kernels see
        them: finite, and none that rounds to 0 or inf where that breaks the arithmetic (a
        top_p that rounds to 0 keeps the most likely token only, as in vLLM)."""
        _check_real("temperature", self.temperature, ">= 0", lambda t: t >= 0.0)
        _check(self.temperature <= FLOAT32_MAX,
               f"temperature {self.temperature} is inf in float32; use at most {FLOAT32_MAX:g}")
        _check_real("top_p", self.top_p, "in (0, 1]", lambda p: 0.0 < p <= 1.0)
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (off) or >= 1, got {self.top_k!r}",
        )
        _check_real("min_p", self.min_p, "in [0, 1]", lambda p: 0.0 <= p <= 1.0)
        _check_real("repetition_penalty", self.repetition_penalty,
                    f"in [{MIN_REPETITION_PENALTY:g}, {FLOAT32_MAX:g}]; 1 is off",
                    lambda p: MIN_REPETITION_PENALTY <= p <= FLOAT32_MAX)

    def _check_sampling_mask(self) -> None:
        """A sampling mask needs a truncation: without one every token is kept, and the mask
        would be the whole vocabulary at every position (bad words and `min_tokens` alone
        remove tokens at some positions only, so they do not count)."""
        truncates = (self.is_greedy or self.top_k >= 1 or self.top_p < 1.0 or self.min_p > 0.0
                     or self.allowed_token_ids is not None
                     or self.structured_outputs is not None)
        _check(not self.return_sampling_mask or truncates,
               "return_sampling_mask needs a truncation of the vocabulary, and nothing truncates "
               "it (top_k=-1, top_p=1, min_p=0, no allowed_token_ids or structured_outputs); "
               "set top_k, top_p < 1 or min_p > 0, or leave return_sampling_mask off")

    def _check_stop(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a list of non-empty strings, got {self.stop!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens,
               f"min_tokens must be >= 0, got {self.min_tokens!r}")
        _check(not isinstance(self.max_tokens, int) or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name), "in [-2, 2]", lambda v: -2.0 <= v <= 2.0)
        bias = dict(self.logit_bias or {})
        _check(all(isinstance(t, int) and t >= 0 and _is_finite_real(v) for t, v in bias.items()),
               f"logit_bias must map token ids (>= 0) to finite numbers, got {self.logit_bias!r}")
        self.logit_bias = {int(t): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v)))
                           for t, v in bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(bool(self.allowed_token_ids)
                   and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                   f"allowed_token_ids must be a non-empty list of token ids, got "
                   f"{self.allowed_token_ids!r}")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words)
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
               f"bad_words must be non-empty strings, got {self.bad_words!r}")

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                   f"{name} must be None or in [0, {MAX_LOGPROBS}], got {value!r}")
        _check(self.logprobs_mode in LOGPROBS_MODES,
               f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        _check(self.truncate_prompt_tokens is None
               or (isinstance(self.truncate_prompt_tokens, int)
                   and self.truncate_prompt_tokens >= 1),
               f"truncate_prompt_tokens must be None or >= 1, got {self.truncate_prompt_tokens!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"invalid SamplingParams: {message}")


def _is_finite_real(value: object) -> bool:
    """A real number (numpy's included, bool not) that is neither NaN nor infinite."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def _check_real(name: str, value: object, expected: str, is_in_range) -> None:
    """A sampling parameter is a finite number in its range; NaN and inf never reach the
    kernels, where they would make NaN logprobs."""
    _check(_is_finite_real(value) and is_in_range(float(value)),
           f"{name} must be {expected} (a finite number), got {value!r}")
