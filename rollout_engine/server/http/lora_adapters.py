"""vLLM's runtime LoRA endpoints: `POST /v1/load_lora_adapter` ({"lora_name", "lora_path",
"load_inplace"}) and `POST /v1/unload_lora_adapter` ({"lora_name"}), answered as vLLM answers
them (200 with a text body; 400 for an adapter already loaded or refused; 404 for an unknown
name). Mounted with the control endpoints: they read paths on the server's disk. A request
then runs under an adapter by naming it as its `model`; `/v1/models` lists the adapters.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse, Response

from rollout_engine.protocol import LoRAError
from rollout_engine.server.http.context import serving
from rollout_engine.server.http.error_responses import UnknownModelError
from rollout_engine.server.http.generation import read_json

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, LoadLoRAAdapterRequest, ctx.config.max_message_bytes)
    if request.lora_name in ctx.served_model_names:
        raise LoRAError(f"{request.lora_name!r} is the base model's name")
    added = await ctx.engine.load_lora_adapter(request.lora_name, request.lora_path,
                                              load_inplace=request.load_inplace)
    if not added:
        raise LoRAError(f"The lora adapter '{request.lora_name}' has already been loaded.")
    return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(raw_request: Request) -> Response:
    ctx = serving(raw_request)
    request = await read_json(raw_request, UnloadLoRAAdapterRequest,
                              ctx.config.max_message_bytes)
    if not await ctx.engine.unload_lora_adapter(request.lora_name):
        raise UnknownModelError(f"The lora adapter '{request.lora_name}' cannot be found.")
    return PlainTextResponse(
        f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
