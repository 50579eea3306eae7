"""Conversions between the wire messages (protos.rollout_pb2) and the engine's Python types."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from protos import rollout_pb2 as pb
from rollout_engine.engine.scoring import check_score_request
from rollout_engine.protocol import (
    CompletionOutput,
    EngineInfo,
    InvalidRequestError,
    MemoryState,
    RequestOutput,
    SamplingParams,
    ScoreOutput,
    TopLogprobs,
)
from rollout_engine.protocol.wire_codec import from_message, to_message

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64",
        "bool", "float8_e4m3fn", "float8_e5m2",
    )
    if hasattr(torch, name)
}
# Completions per GenerateBatch message at most; messages also stay under a byte budget.
_MAX_COMPLETIONS_PER_MESSAGE = 256
_MAX_MESSAGE_PAYLOAD_BYTES = 4 * 1024 * 1024


# --------------------------------------------------------------------------------- inputs


def prompt_from_proto(prompt: pb.Prompt) -> str | list[int]:
    kind = prompt.WhichOneof("prompt")
    if kind == "text":
        return prompt.text
    if kind == "token_ids":
        return list(prompt.token_ids.token_ids)
    raise InvalidRequestError("a prompt needs either `text` or `token_ids`")


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Unset fields take the engine's defaults; invalid values raise InvalidRequestError."""
    return from_message(message, SamplingParams)


def batch_sampling_params(request: pb.GenerateBatchRequest) -> list[SamplingParams]:
    num_prompts = len(request.prompts)
    if not request.per_prompt_sampling_params:
        return [sampling_params_from_proto(request.sampling_params)] * num_prompts
    if len(request.per_prompt_sampling_params) != num_prompts:
        raise InvalidRequestError(
            f"got {len(request.per_prompt_sampling_params)} per-prompt sampling params for "
            f"{num_prompts} prompts; send one per prompt or none"
        )
    return [sampling_params_from_proto(p) for p in request.per_prompt_sampling_params]


def score_request_from_proto(
    request: pb.ScoreRequest,
) -> tuple[list[list[int]], list[int], int | None]:
    """(sequences, prompt_lens, logprobs) of a Score call; InvalidRequestError for a bad one."""
    sequences = [list(s.token_ids) for s in request.sequences]
    prompt_lens = list(request.prompt_lens)
    if not sequences:
        raise InvalidRequestError("Score needs at least one sequence")
    if len(sequences) != len(prompt_lens):
        raise InvalidRequestError(
            f"got {len(sequences)} sequences and {len(prompt_lens)} prompt_lens; one each"
        )
    for token_ids, prompt_len in zip(sequences, prompt_lens):
        check_score_request(token_ids, prompt_len)
    return sequences, prompt_lens, request.logprobs if request.HasField("logprobs") else None


def weight_manifest_from_proto(
    manifest: pb.WeightManifest,
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    entries = []
    for meta in manifest.tensors:
        dtype = DTYPES.get(meta.dtype.removeprefix("torch."))
        if dtype is None:
            raise InvalidRequestError(
                f"tensor {meta.name!r} has unknown dtype {meta.dtype!r}; known: {sorted(DTYPES)}"
            )
        if any(d < 0 for d in meta.shape):
            raise InvalidRequestError(f"tensor {meta.name!r} has a negative dimension")
        entries.append((meta.name, tuple(int(d) for d in meta.shape), dtype))
    return entries


# -------------------------------------------------------------------------------- outputs


def completion_to_proto(completion: CompletionOutput) -> pb.CompletionOutput:
    return to_message(completion, pb.CompletionOutput())


def prompt_logprobs_to_proto(entries: list[TopLogprobs | None]) -> list[pb.TopLogprobs]:
    """Per prompt position; a position without logprobs (the first) is an empty message."""
    return [pb.TopLogprobs() if e is None else to_message(e, pb.TopLogprobs()) for e in entries]


def score_response(outputs: list[ScoreOutput]) -> pb.ScoreResponse:
    return pb.ScoreResponse(outputs=[to_message(o, pb.ScoreOutput()) for o in outputs])


class GenerateStreamState:
    """What one Generate stream has sent so far. The engine hands it DELTA outputs (or one
    FINAL_ONLY output); a sample's tokens and text pieces are gathered here so that its final
    message carries the whole completion, at a cost per step of what the step produced."""

    def __init__(self, stream_deltas: bool) -> None:
        self.stream_deltas = stream_deltas
        self._sent: dict[int, CompletionOutput] = {}
        """Per sample: its tokens, logprobs and top logprobs streamed so far."""
        self._texts: dict[int, list[str]] = {}
        """Per sample: its text's pieces so far (deltas carry none on the wire)."""
        self._finished: set[int] = set()
        self._sent_prompt = False
        self._sent_prompt_logprobs = False

    def response(self, output: RequestOutput) -> pb.GenerateResponse | None:
        """The message for this step's output, or None when nothing is new."""
        message = pb.GenerateResponse(request_id=output.request_id)
        if not self._sent_prompt:
            message.prompt_token_ids.extend(output.prompt_token_ids)
        if output.prompt_logprobs is not None and not self._sent_prompt_logprobs:
            message.prompt_logprobs.extend(prompt_logprobs_to_proto(output.prompt_logprobs))
            self._sent_prompt_logprobs = True
        for completion in output.outputs:
            if completion.index in self._finished:
                continue
            if completion.finished:
                self._finished.add(completion.index)
                message.outputs.append(completion_to_proto(self._whole(completion)))
                continue
            if completion.text:
                self._texts.setdefault(completion.index, []).append(completion.text)
            if self.stream_deltas and completion.token_ids:
                delta = message.deltas.add(index=completion.index,
                                           token_ids=completion.token_ids,
                                           logprobs=completion.logprobs)
                for entry in completion.top_logprobs or ():
                    to_message(entry, delta.top_logprobs.add())
                self._append(completion)
        if (self._sent_prompt and not message.deltas and not message.outputs
                and not message.prompt_logprobs):
            return None
        self._sent_prompt = True
        return message

    def _append(self, delta: CompletionOutput) -> None:
        sent = self._sent.setdefault(delta.index, CompletionOutput(delta.index, [], []))
        sent.token_ids += delta.token_ids
        sent.logprobs += delta.logprobs
        if delta.top_logprobs is not None:
            sent.top_logprobs = (sent.top_logprobs or []) + delta.top_logprobs

    def _whole(self, last: CompletionOutput) -> CompletionOutput:
        """The finished sample, whole: what was streamed, then its last tokens."""
        pieces = self._texts.pop(last.index, None)
        if pieces is not None:
            last = dataclasses.replace(last, text="".join(pieces) + last.text)
        sent = self._sent.pop(last.index, None)
        if sent is None:
            return last
        top_logprobs = last.top_logprobs
        if sent.top_logprobs is not None:
            top_logprobs = sent.top_logprobs + (top_logprobs or [])
        return dataclasses.replace(last, token_ids=sent.token_ids + last.token_ids,
                                   logprobs=sent.logprobs + last.logprobs,
                                   top_logprobs=top_logprobs)


class BatchStreamState:
    """What one GenerateBatch stream has sent: finished completions per prompt."""

    def __init__(self, request_ids: list[str]) -> None:
        self._prompt_index = {rid: i for i, rid in enumerate(request_ids)}
        self._sent: dict[str, set[int]] = {rid: set() for rid in request_ids}

    def new_completions(self, output: RequestOutput) -> list[pb.BatchCompletion]:
        sent = self._sent[output.request_id]
        completions = []
        for completion in output.outputs:
            if completion.finished and completion.index not in sent:
                item = pb.BatchCompletion(
                    prompt_index=self._prompt_index[output.request_id],
                    output=completion_to_proto(completion),
                )
                if not sent:
                    item.prompt_token_ids.extend(output.prompt_token_ids)
                    if output.prompt_logprobs is not None:
                        entries = prompt_logprobs_to_proto(output.prompt_logprobs)
                        item.prompt_logprobs.extend(entries)
                sent.add(completion.index)
                completions.append(item)
        return completions


def batch_responses(completions: list[pb.BatchCompletion]) -> Iterator[pb.GenerateBatchResponse]:
    """Pack completions into messages that stay far below the message size limit."""
    message, num_bytes = pb.GenerateBatchResponse(), 0
    for item in completions:
        item_bytes = item.ByteSize()
        if message.completions and (
            num_bytes + item_bytes > _MAX_MESSAGE_PAYLOAD_BYTES
            or len(message.completions) >= _MAX_COMPLETIONS_PER_MESSAGE
        ):
            yield message
            message, num_bytes = pb.GenerateBatchResponse(), 0
        message.completions.append(item)
        num_bytes += item_bytes
    if message.completions:
        yield message


# -------------------------------------------------------------------------- introspection


def info_to_proto(info: EngineInfo) -> pb.GetInfoResponse:
    return to_message(info, pb.GetInfoResponse())


def memory_state_to_proto(state: MemoryState) -> pb.GetMemoryStateResponse:
    return to_message(state, pb.GetMemoryStateResponse())
