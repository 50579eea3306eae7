"""Conversions between the wire messages (protos.rollout_pb2) and the engine's Python types."""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch

from protos import rollout_pb2 as pb
from protos.weight_codec import DTYPES
from rollout_engine.engine.chat_template import ChatPrompt
from rollout_engine.engine.scoring import check_score_request
from rollout_engine.protocol import (
    CompletionOutput,
    EngineInfo,
    InvalidRequestError,
    LoadedLoRA,
    LoRAError,
    MemoryState,
    RequestOutput,
    SamplingParams,
    ScoreOutput,
    TopLogprobs,
)
from rollout_engine.protocol.wire_codec import from_message, to_message

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


def lora_to_proto(lora: LoadedLoRA) -> pb.LoRAAdapter:
    return pb.LoRAAdapter(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id,
                          lora_path=lora.lora_path, version=lora.version)


def lora_target_from_proto(manifest: pb.WeightManifest) -> tuple[str, dict, bool] | None:
    """A LoRA push's (adapter name, PEFT config, load in place); None for a weight update."""
    if not manifest.HasField("lora"):
        return None
    target = manifest.lora
    if not target.lora_name:
        raise LoRAError("a LoRA push needs a lora_name")
    try:
        peft_config = json.loads(target.peft_config_json or "{}")
    except ValueError as exc:
        raise LoRAError(f"peft_config_json is not JSON: {exc}") from exc
    if not isinstance(peft_config, dict):
        raise LoRAError("peft_config_json must be a JSON object")
    return target.lora_name, peft_config, target.load_inplace


# -------------------------------------------------------------------------------- outputs


def completion_to_proto(completion: CompletionOutput) -> pb.CompletionOutput:
    return to_message(completion, pb.CompletionOutput())


def prompt_logprobs_to_proto(entries: list[TopLogprobs | None]) -> list[pb.TopLogprobs]:
    """Per prompt position; a position without logprobs (the first) is an empty message."""
    return [pb.TopLogprobs() if e is None else to_message(e, pb.TopLogprobs()) for e in entries]


def score_response(outputs: list[ScoreOutput]) -> pb.ScoreResponse:
    return pb.ScoreResponse(outputs=[to_message(o, pb.ScoreOutput()) for o in outputs])


def generate_response(request_id: str, output: RequestOutput, is_first: bool
                      ) -> pb.GenerateResponse:
    """One Generate stream message from the engine's output (DELTA_THEN_WHOLE, or FINAL_ONLY
    without deltas): the prompt with the first, a delta per sample that ran on, and the whole
    completion of each that finished."""
    message = pb.GenerateResponse(request_id=request_id)
    if is_first:
        message.prompt_token_ids.extend(output.prompt_token_ids)
    if output.prompt_logprobs is not None:
        message.prompt_logprobs.extend(prompt_logprobs_to_proto(output.prompt_logprobs))
    if output.num_cached_tokens is not None:
        message.num_cached_tokens = output.num_cached_tokens
    if output.prompt_routed_experts is not None:
        to_message(output.prompt_routed_experts, message.prompt_routed_experts)
    for completion in output.outputs:
        if completion.finished:
            message.outputs.append(completion_to_proto(completion))
            continue
        delta = message.deltas.add(index=completion.index, token_ids=completion.token_ids,
                                   logprobs=completion.logprobs)
        for entry in completion.top_logprobs or ():
            to_message(entry, delta.top_logprobs.add())
        if completion.routed_experts is not None:
            to_message(completion.routed_experts, delta.routed_experts)
        if completion.sampling_mask is not None:
            to_message(completion.sampling_mask, delta.sampling_mask)
    return message


def batch_completions(prompt_index: int, output: RequestOutput) -> list[pb.BatchCompletion]:
    """A prompt's finished completions (its FINAL_ONLY output); the first carries the prompt."""
    completions = []
    for completion in output.outputs:
        item = pb.BatchCompletion(prompt_index=prompt_index, output=completion_to_proto(completion))
        if not completions:
            item.prompt_token_ids.extend(output.prompt_token_ids)
            if output.prompt_logprobs is not None:
                item.prompt_logprobs.extend(prompt_logprobs_to_proto(output.prompt_logprobs))
            if output.num_cached_tokens is not None:
                item.num_cached_tokens = output.num_cached_tokens
            if output.prompt_routed_experts is not None:
                to_message(output.prompt_routed_experts, item.prompt_routed_experts)
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


def chat_prompt_from_proto(request: pb.RenderChatRequest) -> ChatPrompt:
    """A RenderChat request as the ChatPrompt `render_chat` takes; InvalidRequestError for
    JSON that does not parse or has the wrong shape."""
    messages = _json_field(request.messages_json, "messages_json", list, required=True)
    if not messages:
        raise InvalidRequestError("messages_json must hold at least one message")
    return ChatPrompt(
        messages=messages,
        tools=_json_field(request.tools_json, "tools_json", list) or None,
        documents=_json_field(request.documents_json, "documents_json", list) or None,
        chat_template=request.chat_template if request.HasField("chat_template") else None,
        chat_template_kwargs=_json_field(request.chat_template_kwargs_json,
                                         "chat_template_kwargs_json", dict) or None,
        add_generation_prompt=(request.add_generation_prompt
                               if request.HasField("add_generation_prompt") else True),
        continue_final_message=request.continue_final_message,
    )


def _json_field(text: str, name: str, kind: type, required: bool = False):
    if not text:
        if required:
            raise InvalidRequestError(f"{name} is required")
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{name} must be a JSON {kind.__name__}, got "
                                  f"{type(value).__name__}")
    return value
