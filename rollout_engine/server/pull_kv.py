"""The `PullKV` stream a prefill server sends: the serving half of the "grpc" KV transport
(its fetcher, on the decode engine, is `worker/kv_transfer/kv_transports.GrpcFetcher`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import torch

from protos import rollout_pb2 as pb

if TYPE_CHECKING:
    from rollout_engine.worker.kv_transfer.kv_connector_worker import KVStore

CHUNK_BYTES = 4 * 1024**2
"""Bytes of KV per PullKV message."""


async def pull_kv_responses(
    store: KVStore, transfer_id: str, context
) -> AsyncIterator[pb.PullKVResponse]:
    """Stream one saved KV tensor (`AsyncEngine.kv_store` is thread-safe: read here, off the
    engine thread): shape and dtype first, then its bytes; it is handed out once. `ROLLOUT_ENGINE_KV_SEND_DELAY_S` (test-only) sleeps before each chunk."""
    kv = store.pop(transfer_id)
    if kv is None:
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"no saved KV {transfer_id!r}: it was pulled already or expired",
        )
    delay_s = float(os.environ.get("ROLLOUT_ENGINE_KV_SEND_DELAY_S", "0"))
    data = kv.contiguous().view(-1).view(torch.uint8).numpy()
    yield pb.PullKVResponse(shape=list(kv.shape), dtype=str(kv.dtype).removeprefix("torch."))
    for offset in range(0, len(data), CHUNK_BYTES):
        if delay_s:
            await asyncio.sleep(delay_s)
        yield pb.PullKVResponse(data=data[offset : offset + CHUNK_BYTES].tobytes())
