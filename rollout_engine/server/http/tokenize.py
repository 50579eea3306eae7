"""`POST /tokenize` (a prompt, or chat messages through the chat template), `POST /detokenize`
and `GET /tokenizer_info` (with --enable-tokenizer-info-endpoint), in `vllm serve`'s shapes.
Tokenizer work runs off the event loop; text here is counted, not served, so it may be longer
than the model takes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_engine.protocol import InvalidRequestError
from rollout_engine.server.http.api_models import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from rollout_engine.server.http.context import serving
from rollout_engine.server.http.error_responses import json_response
from rollout_engine.server.http.generation import parse_body, read_json, read_json_object

router = APIRouter()


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    data = await read_json_object(raw_request, ctx.config.max_message_bytes)
    form = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    body = parse_body(form, data)  # vLLM's union, told apart by `messages`
    await ctx.resolve_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        token_ids = (await ctx.render_chat(body, fit_model=False)).token_ids
    else:
        token_ids = await ctx.off_loop(ctx.processor.encode_text, body.prompt,
                                       body.add_special_tokens, False) if body.prompt else []
    response: dict = {"count": len(token_ids), "max_model_len": ctx.max_model_len,
                      "tokens": token_ids, "token_strs": None}
    if body.return_token_strs and ctx.tokenizer is not None:
        response["token_strs"] = await ctx.off_loop(ctx.tokenizer.convert_ids_to_tokens,
                                                    token_ids)
    return json_response(response)


@router.post("/detokenize")
async def detokenize(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, DetokenizeRequest, ctx.config.max_message_bytes)
    await ctx.resolve_model(request.model)
    if ctx.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer")
    vocab_size = ctx.engine.model.vocab_size
    bad = [t for t in request.tokens if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    text = await ctx.off_loop(decode_releasing_gil, ctx.tokenizer, request.tokens)
    return json_response({"prompt": text})


def decode_releasing_gil(tokenizer, token_ids: list[int]) -> str:
    """`tokenizer.decode(token_ids)`, with the `tokenizers` library's work done without the GIL:
    its `decode` holds it throughout (5M ids held it 3.7 s, the event loop stopped), its
    `decode_batch` lets it go. transformers' clean-up of spaces is applied as it applies it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.decode(token_ids)
    (text,) = backend.decode_batch([token_ids], skip_special_tokens=False)
    if tokenizer.clean_up_tokenization_spaces and (
            type(backend.model).__name__ != "BPE" or getattr(
                tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                False)):
        text = tokenizer.clean_up_tokenization(text)
    return text


tokenizer_info_router = APIRouter()
"""Served with --enable-tokenizer-info-endpoint only, as in vLLM: it shows the chat template."""


@tokenizer_info_router.get("/tokenizer_info")
async def tokenizer_info(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    if ctx.tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer")
    return json_response(await ctx.off_loop(tokenizer_config, ctx.tokenizer))


def tokenizer_config(tokenizer) -> dict:
    """vLLM's `TokenizerInfo`: what the tokenizer was built with (`tokenizer_config.json`'s
    fields: special tokens, `model_max_length`, `added_tokens_decoder` as their texts) without
    file paths, its class name, and the chat template the server renders with."""
    config = {k: _json_value(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file")}
    config["tokenizer_class"] = type(tokenizer).__name__
    if isinstance(tokenizer.chat_template, str):
        config["chat_template"] = tokenizer.chat_template
    return config


def _json_value(value):
    if hasattr(value, "content"):  # an AddedToken: its text, as vLLM sends it
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
