"""The offline API: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from rollout_engine.config import EngineConfig
from rollout_engine.engine.chat_template import ChatPrompt, extend_tokens, render_chat
from rollout_engine.engine.llm_engine import LLMEngine
from rollout_engine.engine.scoring import check_score_request, score_output, score_params
from rollout_engine.parsing import ChatParsing
from rollout_engine.parsing.chat_params import (
    attach_messages,
    chat_sampling_params,
    conversations_with_tokens,
    offline_tool_choice,
)
from rollout_engine.protocol import (
    EngineBusyError,
    InvalidRequestError,
    LoRAError,
    LoRARequest,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    ScoreOutput,
    SleepLevel,
    check_sleep_mode,
)

if TYPE_CHECKING:
    from memory import MemoryEventLog
    from rollout_engine.protocol import EngineInfo, MemoryState, PauseMode, SleepMode
    from rollout_engine.worker.weights.weight_update import (
        ManifestEntry,
        NamedTensors,
        WeightUpdateSession,
    )


class LLM:
    """Generate from a Hugging Face model directory in this process."""

    def __init__(self, model: str, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict[str, float]:
        """Engine counters: KV blocks, preemptions, prefix-cache hits, speculative decoding."""
        return self.engine.stats()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; `outputs[i].outputs[j]` is sample j.
        `lora_request`: the LoRA adapter all prompts run under, or one per prompt (None: the
        base model); with `enable_lora`."""
        self._check_not_paused()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params = _per_prompt_params(sampling_params, len(prompts))
        loras = _per_prompt_loras(lora_request, len(prompts))
        request_ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, lora in zip(request_ids, prompts, params, loras):
                self.engine.add_request(request_id, prompt, p, RequestOutputKind.FINAL_ONLY,
                                        lora_request=lora)
            outputs = self._run(request_ids, sum(p.n for p in params), use_tqdm)
            self._drain()  # async scheduling: a step launched after the last output lands
            return outputs
        except BaseException:
            # A refused prompt, a failed step or Ctrl-C: none of this call's requests survive.
            self.engine.abort_request(request_ids)
            self._drain()
            raise

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, str]] | None = None,
        *,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        enable_in_reasoning: bool = False,
        tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's offline chat: one conversation or a list of them, rendered with the chat
        template (as `serve` renders them, tools included), then generated. With `tool_parser`
        and/or `reasoning_parser` (vLLM's parser names), each completion's `message` holds the
        content, reasoning and tool calls parsed from its text, beside the raw token ids and
        logprobs a trainer needs. `tool_choice` as `serve` takes it ("auto" by default with
        tools and a parser; "required" or a named function generate calls in the parser's
        format); with `reasoning_parser`, a constraint applies once the reasoning has ended
        (vLLM's default), or from the first token with `enable_in_reasoning`. `tokens` (one
        list per conversation, or one list for one): token in, as `/v1/chat/completions/tokens`
        takes it: the prompt extends the previous turn's prompt and completion ids."""
        parsing = ChatParsing(reasoning_parser, tool_parser)
        plan = offline_tool_choice(tools, tool_choice, tool_parser, parallel_tool_calls)
        prompts = []
        for conversation, ids in conversations_with_tokens(messages, tokens):
            chat_prompt = ChatPrompt(
                conversation, tools if plan.render_tools else None, documents, chat_template,
                chat_template_kwargs, add_generation_prompt, continue_final_message)
            prompt = render_chat(self.engine.processor, chat_prompt)
            prompts.append(prompt if ids is None
                           else extend_tokens(self.engine.processor, chat_prompt, prompt, ids))
        params = [chat_sampling_params(p, plan, parsing, prompt.text, enable_in_reasoning)
                  for p, prompt in zip(_per_prompt_params(sampling_params, len(prompts)),
                                       prompts)]
        outputs = self.generate([prompt.token_ids for prompt in prompts], params, use_tqdm)
        attach_messages(outputs, [prompt.text for prompt in prompts], parsing, plan, tools)
        return outputs

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        logprobs: int | None = None,
        use_tqdm: bool = False,
    ) -> list[ScoreOutput]:
        """The logprobs of each sequence's completion (its tokens from `prompt_lens[i]` on),
        each given everything before it, with the top `logprobs` tokens if set: no sampling.
        Batched like generation (chunked prefill; sequences sharing a prompt share its KV)."""
        if len(sequences) != len(prompt_lens):
            raise InvalidRequestError(
                f"got {len(sequences)} sequences and {len(prompt_lens)} prompt_lens; one each"
            )
        for token_ids, prompt_len in zip(sequences, prompt_lens):
            check_score_request(token_ids, prompt_len)
        self._check_not_paused()
        params = score_params(logprobs)
        request_ids = [f"score-{next(self._ids)}" for _ in sequences]
        try:
            for request_id, token_ids, prompt_len in zip(request_ids, sequences, prompt_lens):
                self.engine.add_request(request_id, list(token_ids), params,
                                        RequestOutputKind.FINAL_ONLY, prompt_logprobs_from=prompt_len)
            outputs = self._run(request_ids, len(sequences), use_tqdm)
            self._drain()
        except BaseException:
            self.engine.abort_request(request_ids)
            self._drain()
            raise
        return [score_output(o, n, logprobs) for o, n in zip(outputs, prompt_lens)]

    # -- memory and weights: see LLMEngine for the semantics -----------------------------------
    def sleep(self, level: int = 1, mode: SleepMode = "abort") -> list[RequestOutput]:
        """Release memory; the requests in flight are ended ("abort"), kept ("keep"), or first
        run to completion ("wait"). Their final outputs are returned."""
        level, mode = SleepLevel.parse(level), check_sleep_mode(mode)
        if mode == "wait":
            return self._finish_unfinished() + self.engine.sleep(level, "abort")
        return self.engine.sleep(level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True
                         ) -> list[RequestOutput]:
        """Stop scheduling; the requests in flight are ended ("abort"), kept ("keep"), or
        first run to completion ("wait"). Their final outputs are returned."""
        if check_sleep_mode(mode) == "wait":
            return self._finish_unfinished() + self.engine.pause_generation("abort", clear_cache)
        return self.engine.pause_generation(mode, clear_cache)

    def resume_generation(self) -> None:
        self.engine.resume_generation()

    def is_paused(self) -> bool:
        return self.engine.is_paused()

    def release_kv_cache_memory(self) -> list[RequestOutput]:
        return self.engine.release_kv_cache_memory()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def reset_draft_history(self) -> None:
        self.engine.reset_draft_history()

    def update_weights(self, named_tensors: NamedTensors) -> int:
        return self.engine.update_weights(named_tensors)

    def begin_weight_update(self, manifest: Sequence[ManifestEntry]) -> WeightUpdateSession:
        return self.engine.begin_weight_update(manifest)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def memory_state(self) -> MemoryState:
        return self.engine.memory_state()

    @property
    def memory_events(self) -> MemoryEventLog:
        """Sleep, wake and weight-update events of the engine, with their timing."""
        return self.engine.memory_events

    def info(self) -> EngineInfo:
        return self.engine.info()

    def kv_cache_ptr(self) -> int:
        return self.engine.kv_cache_ptr()

    def shutdown(self) -> None:
        """Stop the engine's threads and, under tensor parallelism, the other ranks'
        processes (they are also stopped when the LLM is collected or Python exits)."""
        self.engine.shutdown()

    def weight_ptrs(self) -> dict[str, int]:
        return self.engine.weight_ptrs()

    def _run(self, request_ids: list[str], num_completions: int, use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        with tqdm(total=num_completions, desc="generate", unit="seq", disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        finished[output.request_id] = output
                        pending.discard(output.request_id)
                        bar.update(len(output.outputs))
        return [finished[rid] for rid in request_ids]

    def _check_not_paused(self) -> None:
        """Offline, nothing could resume a paused engine while `generate` waits for it."""
        if self.engine.is_paused():
            raise EngineBusyError(
                "generation is paused (pause_generation); call resume_generation() first"
            )

    def _drain(self) -> None:
        """Step until the requests we gave up on have reported their abort."""
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _finish_unfinished(self) -> list[RequestOutput]:
        """Mode "wait": step until every unfinished prompt has finished; their final outputs,
        in arrival order (a stream's every output, its final one last: no delta is lost)."""
        if self.engine.is_paused():
            raise EngineBusyError(
                "generation is paused: its requests cannot drain; sleep with mode 'keep' or "
                "'abort', or resume_generation() first"
            )
        group_ids = self.engine.unfinished_request_ids
        kind_of = self.engine.output_processor.output_kind
        streams = {gid for gid in group_ids if kind_of(gid) is not RequestOutputKind.CUMULATIVE}
        drained: dict[str, list[RequestOutput]] = {gid: [] for gid in group_ids}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.request_id in drained and (
                    output.finished or output.request_id in streams
                ):
                    drained[output.request_id].append(output)
        return [output for gid in group_ids for output in drained[gid]]


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      num_prompts: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (str, bytes)) or len(lora_request) != num_prompts:
        raise LoRAError(f"lora_request must be a LoRARequest or one per prompt ({num_prompts})")
    return list(lora_request)


def _per_prompt_params(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if len(sampling_params) != num_prompts:
        raise InvalidRequestError(
            f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts"
        )
    return list(sampling_params)
