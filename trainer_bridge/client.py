"""`EngineClient`: the trainer's handle on a rollout engine server, over gRPC."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Self, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos import weight_codec
from rollout_engine.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    CompletionOutput,
    DeadlineExceededError,
    EngineError,
    EngineInfo,
    MemoryState,
    PauseMode,
    RequestOutput,
    RoutedExperts,
    SamplingParams,
    ScoreOutput,
    SleepLevel,
    SleepMode,
)
from rollout_engine.protocol.wire_codec import from_message
from trainer_bridge import chat_client, transports
from trainer_bridge.client_messages import (
    Prompt,
    apply_generate_response,
    completion_from_proto,
    error_from_rpc,
    params_proto,
    prompt_logprobs_from_proto,
    prompt_proto,
    score_request_proto,
)
from trainer_bridge.lora_client import LoRAClient

T = TypeVar("T")


class CallCancel:
    """Cancels a `generate` call from another thread: one not started yet fails as soon as it
    starts, one in flight at once; either way the server drops its requests and the call
    raises `CancelledError`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self.is_cancelled = False

    def cancel(self) -> None:
        with self._lock:
            self.is_cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def attach(self, call: grpc.Call) -> None:
        with self._lock:
            self._call = call
            cancelled = self.is_cancelled
        if cancelled:
            call.cancel()


class EngineClient(LoRAClient):
    """Generate, sleep/wake, update weights and inspect a `rollout-engine serve` process.

    Status codes come back as the typed exceptions of `rollout_engine.protocol`. Idempotent
    calls (info, memory_state, score, sleep, wake_up, reset_prefix_cache,
    release_kv_cache_memory, pause_generation, resume_generation, is_paused) retry on UNAVAILABLE with exponential backoff; generate and
    update_weights do not.
    """

    def __init__(
        self,
        address: str,
        auth_token: str | None = None,
        timeout: float | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_retries: int = 5,
    ) -> None:
        self.address = address
        self.timeout = timeout
        """Default deadline in seconds of each call; None waits as long as it takes."""
        self.max_retries = max_retries
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ])
        self._stub = pb_grpc.RolloutEngineStub(self._channel)
        self._update_weights = self._channel.stream_stream(
            "/rollout.v1.RolloutEngine/UpdateWeights",
            request_serializer=weight_codec.serialize_update_request,
            response_deserializer=pb.UpdateWeightsResponse.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._slots: transports.SharedSlots | None = None
        self._server_device: str | None = None

    # --------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        """Block until the server's health check says SERVING; DeadlineExceededError if not."""
        deadline = time.monotonic() + timeout
        request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        while True:
            remaining = deadline - time.monotonic()
            try:
                reply = self._health.Check(request, timeout=max(min(remaining, 1.0), 0.01),
                                           metadata=self._metadata)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(f"{self.address} not serving after {timeout} s")
            time.sleep(0.05)

    # ------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        timeout: float | None = None,
        cancel: CallCancel | None = None,
        lora_name: str = "",
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (GenerateBatch; never retried). `cancel`
        lets another thread end the call. With `prompt_logprobs` set, each output carries
        them (`RequestOutput.prompt_logprobs`, None for the first position). `lora_name`:
        the LoRA adapter they run under (empty: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        collected: dict[int, RequestOutput] = {}
        for item in self._iter_batch(prompts, sampling_params, timeout, cancel, lora_name):
            output = collected.setdefault(item.prompt_index, RequestOutput(
                str(item.prompt_index), [], [], None,
            ))
            output.prompt_token_ids.extend(item.prompt_token_ids)
            if item.prompt_logprobs:
                output.prompt_logprobs = prompt_logprobs_from_proto(item.prompt_logprobs)
            if item.HasField("num_cached_tokens"):
                output.num_cached_tokens = item.num_cached_tokens
            if item.HasField("prompt_routed_experts"):
                output.prompt_routed_experts = from_message(item.prompt_routed_experts,
                                                            RoutedExperts)
            output.outputs.append(completion_from_proto(item.output))
        if len(collected) != len(prompts):
            raise EngineError("the server ended the stream before every prompt finished")
        for i, prompt in enumerate(prompts):
            collected[i].prompt = prompt if isinstance(prompt, str) else None
            collected[i].outputs.sort(key=lambda c: c.index)
        return [collected[i] for i in range(len(prompts))]

    def iter_completions(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        timeout: float | None = None,
        cancel: CallCancel | None = None,
    ) -> Iterator[tuple[int, list[int], CompletionOutput]]:
        """(prompt index, prompt token ids (with a prompt's first completion only), the
        completion) for each completion, as soon as its prompt's last sample finishes
        (GenerateBatch: the engine builds a prompt's output once, when it is final)."""
        for item in self._iter_batch(prompts, sampling_params, timeout, cancel):
            yield item.prompt_index, list(item.prompt_token_ids), completion_from_proto(item.output)

    def _iter_batch(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        timeout: float | None,
        cancel: CallCancel | None,
        lora_name: str = "",
    ) -> Iterator[pb.BatchCompletion]:
        request = pb.GenerateBatchRequest(prompts=[prompt_proto(p) for p in prompts],
                                          lora_name=lora_name)
        if isinstance(sampling_params, Sequence):
            request.per_prompt_sampling_params.extend(params_proto(p) for p in sampling_params)
        else:
            request.sampling_params.CopyFrom(params_proto(sampling_params))
        call = self._stub.GenerateBatch(
            request, metadata=self._metadata, timeout=self._deadline(timeout)
        )
        if cancel is not None:
            cancel.attach(call)
        try:
            for message in call:
                yield from message.completions
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        timeout: float | None = None,
        lora_name: str = "",
    ) -> Iterator[RequestOutput]:
        """Cumulative snapshots of one prompt's completions as tokens arrive (Generate), with
        their top logprobs (`logprobs`) and the prompt's logprobs (`prompt_logprobs`) as they
        come.

        Closing the iterator early cancels the call, and the server frees its KV blocks."""
        request = pb.GenerateRequest(prompt=prompt_proto(prompt),
                                     sampling_params=params_proto(sampling_params),
                                     lora_name=lora_name)
        call = self._stub.Generate(request, metadata=self._metadata,
                                   timeout=self._deadline(timeout))
        snapshot = RequestOutput("", [], [], prompt if isinstance(prompt, str) else None)
        try:
            for message in call:
                apply_generate_response(snapshot, message)
                yield dataclasses.replace(snapshot, outputs=[
                    dataclasses.replace(
                        o, token_ids=list(o.token_ids), logprobs=list(o.logprobs),
                        top_logprobs=None if o.top_logprobs is None else list(o.top_logprobs),
                    )
                    for o in snapshot.outputs
                ])
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            call.cancel()

    # ---------------------------------------------------------------------------- scoring
    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        logprobs: int | None = None,
        timeout: float | None = None,
    ) -> list[ScoreOutput]:
        """The logprobs of each sequence's completion (its tokens from `prompt_lens[i]` on),
        each given everything before it, under the model's raw distribution, with the top
        `logprobs` tokens per position if set: no sampling (Score). One ScoreOutput per
        sequence, in order; sequences that share a prompt share its KV."""
        request = score_request_proto(sequences, prompt_lens, logprobs)
        reply = self._retrying(self._stub.Score, request, timeout)
        return [from_message(output, ScoreOutput) for output in reply.outputs]

    # ------------------------------------------------------------------------------- chat
    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None,
                    chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    documents: list[dict[str, str]] | None = None,
                    tokens: Sequence[int] | None = None) -> tuple[list[int], str]:
        """The prompt token ids and text of a conversation, rendered by the server's chat
        template as `/v1/chat/completions` renders it (RenderChat); with `tokens`, extending
        them as `/v1/chat/completions/tokens` does."""
        request = chat_client.render_chat_request(
            messages, tools, chat_template, chat_template_kwargs, add_generation_prompt,
            continue_final_message, documents, tokens)
        reply = self._retrying(self._stub.RenderChat, request)
        return list(reply.prompt_token_ids), reply.prompt_text

    def chat(self, messages, sampling_params=None, **options: Any) -> list[RequestOutput]:
        """`LLM.chat` over gRPC (same options: tools, chat_template, tool_parser,
        reasoning_parser, tool_choice, ...): rendered by the server, generated, parsed here;
        each completion's `message` beside its token ids and logprobs (chat_client.py)."""
        return chat_client.chat(self, messages, sampling_params, **options)

    # --------------------------------------------------------------------- memory control
    def sleep(self, level: SleepLevel | int = 1, mode: SleepMode = "abort") -> int:
        """Release memory (1: offload weights, drop KV; 2: drop both); returns the number of
        requests aborted (mode "abort"), drained ("wait") or kept across the sleep ("keep":
        they go on, their KV recomputed, once the engine is awake with valid weights)."""
        reply = self._retrying(self._stub.Sleep, pb.SleepRequest(level=int(level), mode=mode))
        return reply.num_aborted_requests + reply.num_drained_requests + reply.num_kept_requests

    def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> int:
        """Stop scheduling (vLLM's `pause_generation`): "abort" ends the requests in flight,
        "wait" drains them, "keep" freezes them until `resume_generation()` (their streams
        just wait; weights may be updated meanwhile). Returns how many it ended, drained or
        kept. A "wait" pause reads as paused from the call on; a `resume_generation()` during
        its drain, from any client, cancels it: it returns once drained, not paused (as
        vLLM's does; `is_paused()` tells)."""
        request = pb.PauseGenerationRequest(mode=mode, clear_cache=clear_cache)
        reply = self._retrying(self._stub.PauseGeneration, request)
        return reply.num_aborted_requests + reply.num_drained_requests + reply.num_kept_requests

    def resume_generation(self) -> None:
        self._retrying(self._stub.ResumeGeneration, pb.ResumeGenerationRequest())

    def is_paused(self) -> bool:
        """True while paused, and while a "wait" pause drains: no new request starts."""
        return self._retrying(self._stub.IsPaused, pb.IsPausedRequest()).is_paused

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Map the tags again ("weights", "kv_cache"); None wakes all."""
        self._retrying(self._stub.WakeUp, pb.WakeUpRequest(tags=list(tags or [])))

    def release_kv_cache_memory(self) -> int:
        """Free the KV pool only; returns the number of requests it aborted."""
        return self._retrying(self._stub.ReleaseKVCache, pb.ReleaseKVCacheRequest()
                              ).num_aborted_requests

    def reset_prefix_cache(self) -> None:
        self._retrying(self._stub.ResetPrefixCache, pb.ResetPrefixCacheRequest())

    # --------------------------------------------------------------------- weight updates
    def update_weights(
        self,
        weights: torch.nn.Module
        | dict[str, torch.Tensor]
        | Iterable[tuple[str, torch.Tensor]],
        transport: str = "auto",
        bucket_bytes: int = transports.DEFAULT_BUCKET_BYTES,
        timeout: float | None = None,
        *,
        manifest: transports.WeightManifest | None = None,
        dtype: torch.dtype | None = None,
    ) -> int:
        """Replace the served weights (Hugging Face names); returns the new weight version.

        Without `manifest`, `weights` is a module, a mapping or (name, tensor) pairs. With it,
        `weights` is read once, in the manifest's order, and each tensor is copied into a
        transport bucket as it is yielded: a generator that gathers or merges parameters
        while it iterates works, and only the buckets are held beyond the model. A tensor
        that differs from its manifest entry ends the update with WeightUpdateError.
        `dtype` casts each tensor as it is sent (the engine refuses other dtypes).

        transport "auto": cuda_ipc for CUDA tensors and a CUDA server on this host, shm for
        a server on this host, stream otherwise. The server validates every name, shape and
        dtype before writing a byte; an update cut off halfway leaves generation refused
        until a complete update lands."""
        if manifest is None:
            weights = transports.named_tensors(weights)
            manifest = transports.WeightManifest.of(weights)
        reply = self._push(weights, manifest, transport, bucket_bytes, timeout, dtype)
        if reply.WhichOneof("kind") != "weight_version":
            raise EngineError("the server ended the update without a weight version")
        return reply.weight_version

    def _push(self, weights, manifest: transports.WeightManifest, transport: str,
              bucket_bytes: int, timeout: float | None, dtype: torch.dtype | None):
        """Send tensors through an UpdateWeights stream; the server's last reply."""
        manifest = manifest.cast(dtype)
        kind = self._resolve_transport(transport, manifest)
        acks = transports.Acks()
        if kind == "stream":
            reader = transports.TensorReader(weights, manifest, torch.device("cpu"), dtype)
            requests = transports.stream_requests(
                manifest, reader, min(bucket_bytes, transports.DEFAULT_STREAM_CHUNK_BYTES), acks
            )
        else:
            device = None if kind == "cuda_ipc" else torch.device("cpu")
            reader = transports.TensorReader(weights, manifest, device, dtype)
            slots = self._shared_slots(kind, manifest, bucket_bytes)
            requests = transports.shared_requests(manifest, reader, slots, acks)
        return self._run_update(transports.guarded(requests, acks), acks, timeout)

    def _run_update(self, requests, acks: transports.Acks, timeout: float | None):
        last = None
        try:
            call = self._update_weights(requests, metadata=self._metadata,
                                            timeout=self._deadline(timeout))
            for reply in call:
                kind = reply.WhichOneof("kind")
                if kind == "manifest_accepted":
                    acks.accept()
                elif kind == "bucket_done":
                    acks.done(reply.bucket_done)
                elif kind in ("weight_version", "lora_adapter"):
                    last = reply
        except grpc.RpcError as exc:
            if acks.error is not None:
                raise acks.error from error_from_rpc(exc)
            raise error_from_rpc(exc) from None
        finally:
            acks.stop()
        if last is None:
            raise EngineError("the server ended the update without committing it")
        return last

    def _resolve_transport(self, transport: str, manifest: transports.WeightManifest) -> str:
        if transport != "auto":
            if transport not in transports.TRANSPORTS:
                raise ValueError(
                    f"transport must be auto, stream, shm or cuda_ipc, got {transport!r}"
                )
            return transport
        if not is_loopback_address(self.address):
            return "stream"
        if manifest.device.type == "cuda" and self._server_is_cuda():
            return "cuda_ipc"
        return "shm" if os.path.isdir(transports.SHM_DIR) else "stream"

    def _server_is_cuda(self) -> bool:
        if self._server_device is None:
            self._server_device = self.info().device
        return self._server_device.startswith("cuda")

    def _shared_slots(
        self, kind: str, manifest: transports.WeightManifest, bucket_bytes: int
    ) -> transports.SharedSlots:
        """Shared buffers sized for this update, kept for the next one when they still fit."""
        total = manifest.num_bytes + transports.ALIGNMENT_BYTES * len(manifest.tensors)
        slot_bytes = max(min(bucket_bytes, total), transports.ALIGNMENT_BYTES)
        slots = self._slots
        fits = slots is not None and slot_bytes <= slots.slot_bytes <= 2 * slot_bytes
        if slots is None or slots.kind != kind or not fits:
            if slots is not None:
                slots.close()
            device = manifest.device if manifest.device.type == "cuda" else torch.device("cuda")
            self._slots = slots = transports.SharedSlots(kind, slot_bytes, device)
        return slots

    # ---------------------------------------------------------------------- introspection
    def info(self) -> EngineInfo:
        """Model, config, weight version and counters (num_free_blocks, ...)."""
        return from_message(self._retrying(self._stub.GetInfo, pb.GetInfoRequest()), EngineInfo)

    def memory_state(self) -> MemoryState:
        """Per tag: state, mapped, num_bytes; plus is_sleeping, weights_valid, RSS."""
        reply = self._retrying(self._stub.GetMemoryState, pb.GetMemoryStateRequest())
        return from_message(reply, MemoryState)

    # -------------------------------------------------------------------------- internals
    def _deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _retrying(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        delay_s = 0.05
        for attempt in range(self.max_retries + 1):
            try:
                return method(request, metadata=self._metadata, timeout=self._deadline(timeout))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.max_retries:
                    raise error_from_rpc(exc) from None
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 2.0)
        raise AssertionError("unreachable")


# ------------------------------------------------------------------------------ helpers


def is_loopback_address(address: str) -> bool:
    """True for unix sockets and localhost / 127.x / ::1 targets."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True
    target = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]" in target else target
    host = host.strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")
