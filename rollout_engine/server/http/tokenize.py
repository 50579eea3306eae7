"""`POST /tokenize` (a prompt, or chat messages through the chat template) and
`POST /detokenize`, in `vllm serve`'s shapes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.protocol import InvalidRequestError
from rollout_engine.server.http.chat_template import render_chat
from rollout_engine.server.http.context import serving
from rollout_engine.server.http.errors import json_response
from rollout_engine.server.http.generation import read_json, read_json_object
from rollout_engine.server.http.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

router = APIRouter()


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    data = await read_json_object(raw_request, ctx.config.max_message_bytes)
    form = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    body = form.model_validate(data)  # vLLM's union, told apart by `messages`
    ctx.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        token_ids = render_chat(ctx.tokenizer, body).token_ids
    else:
        token_ids = ctx.encode(body.prompt, body.add_special_tokens) if body.prompt else []
    response: dict = {"count": len(token_ids), "max_model_len": ctx.max_model_len,
                      "tokens": token_ids, "token_strs": None}
    if body.return_token_strs and ctx.tokenizer is not None:
        response["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(token_ids)
    return json_response(response)


@router.post("/detokenize")
async def detokenize(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, DetokenizeRequest, ctx.config.max_message_bytes)
    ctx.check_model(request.model)
    if ctx.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer")
    vocab_size = ctx.engine.limits.vocab_size
    bad = [t for t in request.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return json_response({"prompt": ctx.tokenizer.decode(request.tokens)})
