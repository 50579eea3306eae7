"""`EngineClient.chat` and `render_chat`: a conversation rendered by the server's chat template
(RenderChat), generated (GenerateBatch), and parsed here with the same parsers `serve` and
`LLM.chat` use (`rollout_engine.parsing`, pure Python): each completion's `message` beside its
token ids and logprobs, which is what a trainer of agents keeps."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from protos import rollout_pb2 as pb
from rollout_engine.parsing import ChatParsing
from rollout_engine.parsing.chat_params import (
    attach_messages,
    chat_sampling_params,
    conversations_with_tokens,
    offline_tool_choice,
)
from rollout_engine.protocol import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from trainer_bridge.client import EngineClient

Messages = Sequence[dict[str, Any]]


def render_chat_request(messages: Messages, tools: list[dict] | None = None,
                        chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        documents: list[dict[str, str]] | None = None,
                        tokens: Sequence[int] | None = None) -> pb.RenderChatRequest:
    request = pb.RenderChatRequest(
        messages_json=json.dumps(list(messages)), tools_json=json.dumps(tools) if tools else "",
        chat_template_kwargs_json=json.dumps(chat_template_kwargs) if chat_template_kwargs
        else "", add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        documents_json=json.dumps(documents) if documents else "", tokens=list(tokens or []))
    if chat_template is not None:
        request.chat_template = chat_template
    return request


def chat(client: EngineClient, messages: Messages | Sequence[Messages],
         sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
         tools: list[dict] | None = None, chat_template: str | None = None,
         chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
         continue_final_message: bool = False, documents: list[dict[str, str]] | None = None,
         tool_parser: str | None = None, reasoning_parser: str | None = None,
         tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True,
         enable_in_reasoning: bool = False, timeout: float | None = None,
         tokens: Sequence[int] | Sequence[Sequence[int]] | None = None
         ) -> list[RequestOutput]:
    parsing = ChatParsing(reasoning_parser, tool_parser)
    plan = offline_tool_choice(tools, tool_choice, tool_parser, parallel_tool_calls)
    rendered = [client.render_chat(conversation, tools if plan.render_tools else None,
                                   chat_template, chat_template_kwargs, add_generation_prompt,
                                   continue_final_message, documents, ids)
                for conversation, ids in conversations_with_tokens(messages, tokens)]
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(rendered)
    params = [chat_sampling_params(p, plan, parsing, text, enable_in_reasoning)
              for p, (_, text) in zip(sampling_params, rendered, strict=True)]
    outputs = client.generate([token_ids for token_ids, _ in rendered], params, timeout=timeout)
    attach_messages(outputs, [text for _, text in rendered], parsing, plan, tools)
    return outputs
