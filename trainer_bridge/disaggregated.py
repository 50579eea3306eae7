"""Prefill on one engine, decode on another, behind `EngineClient`'s verbs.

As vLLM's disaggregated-prefill proxy does: each prompt goes to the prefill engine with
`max_tokens=1` and `KVTransferParams(do_remote_decode=True)`; its completion carries a handle
to the prompt's KV; the prompt then goes to the decode engine, with the user's sampling
parameters and that handle. Prompts are sent on to decode in batches as their prefills finish,
so decoding starts before the last prefill is done.

A prefill that fails (the prefill server is gone, or refused the prompt) sends its prompts to
the decode engine without a handle: the decode engine computes them itself. A prompt never
fails only because prefill did. Memory and weight verbs go to both engines, so both always
hold the same weight version (a decode engine refuses KV of another version).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any, Self

from rollout_engine.protocol import (
    CompletionOutput,
    EngineError,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
    SleepLevel,
    SleepMode,
)
from trainer_bridge.client import EngineClient
from trainer_bridge.client_messages import Prompt, per_prompt
from trainer_bridge.transports import for_several_readers

logger = logging.getLogger(__name__)

_PREFILL_DONE = object()


class DisaggregatedClient:
    """`generate` through a prefill engine and a decode engine (`--kv-role prefill` and
    `--kv-role decode`); sleep, wake_up, release, reset and update_weights go to both."""

    def __init__(
        self,
        prefill: EngineClient | str,
        decode: EngineClient | str,
        max_concurrent_decode_batches: int = 8,
        **client_options: Any,
    ) -> None:
        self.prefill = prefill if isinstance(prefill, EngineClient) else EngineClient(
            prefill, **client_options)
        self.decode = decode if isinstance(decode, EngineClient) else EngineClient(
            decode, **client_options)
        self._decode_pool = concurrent.futures.ThreadPoolExecutor(
            max_concurrent_decode_batches, thread_name_prefix="pd-decode"
        )
        self.num_prefill_failures = 0
        """Prompts sent to decode without a handle because their prefill failed."""

    def close(self) -> None:
        self._decode_pool.shutdown(wait=True, cancel_futures=True)
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        self.prefill.wait_until_ready(timeout)
        self.decode.wait_until_ready(timeout)

    # ------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        timeout: float | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, as `EngineClient.generate` returns."""
        prompts, params = per_prompt(prompts, sampling_params)
        handles: queue.SimpleQueue = queue.SimpleQueue()
        prefill = threading.Thread(
            target=self._prefill, args=(prompts, params, handles, timeout), daemon=True,
            name="pd-prefill",
        )
        prefill.start()
        results: dict[int, RequestOutput] = {}
        decodes: list[concurrent.futures.Future] = []
        done = False
        while not done:
            batch = [handles.get()]  # block for one, then take all that are ready
            while True:
                try:
                    batch.append(handles.get_nowait())
                except queue.Empty:
                    break
            done = _PREFILL_DONE in batch
            batch = [item for item in batch if item is not _PREFILL_DONE]
            if batch:
                decodes.append(self._decode_pool.submit(
                    self._decode, prompts, params, batch, timeout, results
                ))
        prefill.join()
        for future in decodes:
            future.result()  # a decode failure is the caller's error
        return [results[i] for i in range(len(prompts))]

    def _prefill(self, prompts, params, handles: queue.SimpleQueue, timeout) -> None:
        """Prefill every prompt; put (index, handle or None) as each finishes, then DONE."""
        pending = set(range(len(prompts)))
        prefill_params = [
            dataclasses.replace(
                p, n=1, max_tokens=1, structured_outputs=None, detokenize=False,
                kv_transfer_params=KVTransferParams(do_remote_decode=True),
            )
            for p in params
        ]
        try:
            for index, _, completion in self.prefill.iter_completions(
                prompts, prefill_params, timeout
            ):
                if index in pending:
                    pending.discard(index)
                    handles.put((index, _handle_of(completion)))
        except EngineError as exc:
            logger.warning("prefill failed for %d prompts (%s); the decode engine computes "
                           "them", len(pending), exc)
        finally:
            self.num_prefill_failures += len(pending)
            for index in sorted(pending):
                handles.put((index, None))
            handles.put(_PREFILL_DONE)

    def _decode(self, prompts, params, batch, timeout, results: dict[int, RequestOutput]) -> None:
        indices = [index for index, _ in batch]
        decode_params = [
            dataclasses.replace(params[index], kv_transfer_params=handle)
            for index, handle in batch
        ]
        outputs = self.decode.generate([prompts[i] for i in indices], decode_params, timeout)
        for index, output in zip(indices, outputs):
            output.request_id = str(index)
            results[index] = output

    # --------------------------------------------------------------- both engines at once
    def sleep(self, level: SleepLevel | int = 1, mode: SleepMode = "abort") -> int:
        return self.prefill.sleep(level, mode) + self.decode.sleep(level, mode)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.prefill.wake_up(tags)
        self.decode.wake_up(tags)

    def release_kv_cache_memory(self) -> int:
        return self.prefill.release_kv_cache_memory() + self.decode.release_kv_cache_memory()

    def reset_prefix_cache(self) -> None:
        self.prefill.reset_prefix_cache()
        self.decode.reset_prefix_cache()

    def update_weights(self, weights, **options: Any) -> int:
        """Push the same weights to both engines; their common new weight version. Both
        engines read the weights, so a generator is read into a list first."""
        weights = for_several_readers(weights, options.get("manifest"))
        prefill_version = self.prefill.update_weights(weights, **options)
        decode_version = self.decode.update_weights(weights, **options)
        if prefill_version != decode_version:
            raise EngineError(
                f"the engines' weight versions differ after the update (prefill "
                f"{prefill_version}, decode {decode_version}); KV transfers are refused until "
                "they match: restart one, or push weights until they do"
            )
        return decode_version


def _handle_of(completion: CompletionOutput) -> KVTransferParams | None:
    handle = completion.kv_transfer_params
    if completion.finish_reason == "abort" or handle is None or not handle.do_remote_prefill:
        return None
    return handle
