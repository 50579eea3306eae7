"""Token-exact tool turns for TRL's AsyncGRPOTrainer: its rollout worker, with later turns sent
as token in.

TRL's worker renders the whole conversation through the chat template at every turn and
tokenizes it again; its reconciler then compares each turn's prompt with the tokens it holds
and, where the re-tokenized history drifted (a BPE merge across the seam, a tool call JSON
re-serialised, reasoning dropped), overwrites them (REALIGN) or starts a new training row
(FORK). `TokenInRolloutLoop` sends the first turn as TRL does (`/v1/completions` with the
rendered prompt's ids) and every later turn to `/v1/chat/completions/tokens` with the previous
turn's prompt and completion ids (`tokens`): the server appends the tokens of what follows the
last assistant message (the tool answers, the generation prompt), so the held tokens are
always a prefix of the next prompt, every turn is CLEAN, and one conversation is one row. Each
turn asks the engine to keep its KV for the next (`kv_keep_alive_s`).

The server renders the new messages with the worker's chat template (the tokenizer's, or the
training template TRL swapped in), sent with each request: serve with
`--trust-request-chat-template` (a server that refuses says so; nothing is retried).
`EngineAsyncGRPOTrainer` uses this worker; `request_extras` are added to every generation
request's body (e.g. a structured-outputs constraint)."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from transformers.utils import get_json_schema
from trl.experimental.async_grpo import async_rollout_worker as trl_worker
from trl.experimental.async_grpo.async_rollout_worker import (
    AsyncRolloutWorker,
    TurnRecord,
    _AsyncRolloutLoop,
    _chain_to_sequences,
)

from trainer_bridge.trl import MULTI_TURN_KV_KEEP_ALIVE_S

TOKEN_IN_PATH = "/v1/chat/completions/tokens"


class RolloutRequestError(ValueError):
    """The server refused a rollout request (a 4xx answer): retrying cannot help."""


class TokenInRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child process) with token-in later turns."""

    def __init__(self, *args: Any, request_extras: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request_extras = dict(request_extras or {})

    async def _generate_one(self, prompt, tool_dict, tools, group_id=0):
        """One conversation: the same contract as TRL's (its docstring), its turns chained by
        token in instead of re-rendered."""
        started_s = time.monotonic()
        messages = list(prompt)
        schemas = [get_json_schema(tool) for tool in tools] or None
        turns: list[TurnRecord] = []
        completion, completion_ids = [], []
        num_calls = num_failures = num_iterations = 0
        exhausted = False
        while True:
            prompt_ids, turn_ids, turn_logprobs = await self._turn(messages, schemas, turns)
            message = trl_worker.parse_response(self.tokenizer, turn_ids, prefix=prompt_ids,
                                                tools=tools)
            completion.append(message)
            completion_ids.extend(turn_ids)
            messages.append(message)
            turns.append(TurnRecord(prompt_ids, turn_ids, turn_logprobs))
            calls = message.get("tool_calls")
            if calls is None:
                break
            limit = self.max_tool_calling_iterations
            if limit is not None and num_iterations >= limit:
                exhausted = True
                break
            answers, called, failed = await self._execute_tool_calls(calls, tool_dict)
            num_calls, num_failures = num_calls + called, num_failures + failed
            completion.extend(answers)
            messages.extend(answers)
            num_iterations += 1
        sequences, tally = _chain_to_sequences(turns, uuid.uuid4().hex,
                                               self._fork_threshold_tokens)
        self._push_rollout_metrics(turns=len(turns), sequences=len(sequences),
                                   completion_ids=completion_ids, tally=tally,
                                   loop_exhausted=exhausted,
                                   duration_s=time.monotonic() - started_s)
        return completion, completion_ids, sequences, num_calls, num_failures, None

    async def _turn(self, messages, schemas, turns: list[TurnRecord]
                    ) -> tuple[list[int], list[int], list[float]]:
        """(prompt ids, sampled ids, their logprobs) of the conversation's next turn."""
        if not turns:  # the first turn as TRL sends it
            prompt_ids = self.tokenizer.apply_chat_template(
                messages, return_dict=False, add_generation_prompt=True,
                tools=schemas, chat_template=self.chat_template, **self.chat_template_kwargs)
            turn_ids, turn_logprobs = await self._completion(prompt_ids)
            return list(prompt_ids), turn_ids, turn_logprobs
        last = turns[-1]
        body = {
            **self._sampling_fields(), "messages": messages, "tools": schemas,
            "tool_choice": "none",  # the worker parses the calls itself
            "tokens": last.prompt_ids + last.output_ids, "return_token_ids": True,
            "logprobs": True, "top_logprobs": 0,
            "chat_template_kwargs": self.chat_template_kwargs or None,
        }
        template = self.chat_template or self.tokenizer.chat_template
        if template is not None:  # the server renders with the worker's template, not its own
            body["chat_template"] = template
        answer = await self._retry(lambda: self._post_checked(TOKEN_IN_PATH, body),
                                   max_attempts=30, label=f"POST {TOKEN_IN_PATH}")
        (choice,) = answer["choices"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return answer["prompt_token_ids"], choice["token_ids"], logprobs

    async def _completion(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        body = {**self._sampling_fields(), "prompt": prompt_ids, "return_token_ids": True,
                "logprobs": 0}
        answer = await self._retry(lambda: self._post_checked("/v1/completions", body),
                                   max_attempts=30, label="POST /v1/completions")
        (choice,) = answer["choices"]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    async def _post_checked(self, path: str, body: dict) -> dict:
        """POST once; a refusal (4xx) raises with the server's reason and is not retried
        (TRL's `_post` retries every HTTP error, so a bad request would wait minutes); only
        connection errors and 5xx go back to `_retry`."""
        timeout = trl_worker.aiohttp.ClientTimeout(total=self.request_timeout)
        async with self.session.post(f"{self.vllm_server_url}{path}", json=body,
                                     timeout=timeout) as response:
            if 400 <= response.status < 500:
                raise RolloutRequestError(f"POST {path}: {response.status} "
                                          f"{await response.text()}")
            response.raise_for_status()
            return await response.json()

    def _sampling_fields(self) -> dict[str, Any]:
        """The worker's sampling settings, as TRL's own requests carry them."""
        fields = {
            "model": self._request_model, "max_tokens": self.max_tokens, "n": 1,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "seed": random.getrandbits(63),  # independent samples across engines, as TRL's
            "kv_keep_alive_s": MULTI_TURN_KV_KEEP_ALIVE_S if self.tools else 0.0,
        }
        if self.min_p is not None:
            fields["min_p"] = self.min_p
        return {**fields, **self.request_extras}


class TokenInRolloutWorker(AsyncRolloutWorker):
    """TRL's rollout worker running `TokenInRolloutLoop` in its child process."""

    _loop_cls = TokenInRolloutLoop

    def stop(self) -> None:
        """TRL's stop, except that a child that failed is joined, not signalled: its stop
        watcher thread died waiting on the stop event, and multiprocessing's `Event.set` waits
        for every waiter to wake, so TRL's stop hung the trainer after any rollout failure."""
        process = self._process
        if process is not None and process._popen is not None and (
                self._failed_event.is_set() or not process.is_alive()):
            process.join(timeout=15)
            if process.is_alive():
                process.kill()
                process.join()
            self._process = None
        super().stop()
