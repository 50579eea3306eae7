"""KV transfer over the wire: the `PullKV` stream a prefill server sends, and the fetchers a
decode engine uses for the "grpc" and "cuda_ipc" transports (see worker/kv_transfer.py)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator

import grpc
import torch

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_engine.protocol import DEFAULT_MAX_MESSAGE_BYTES, KVTransferParams
from rollout_engine.worker.kv_transfer import KVStore
from rollout_engine.worker.kv_transports import KVTransferFailed, cuda_ipc_descriptor_of

CHUNK_BYTES = 4 * 1024**2


async def pull_kv_responses(
    store: KVStore, transfer_id: str, context
) -> AsyncIterator[pb.PullKVResponse]:
    """Stream one saved KV tensor: shape and dtype first, then its bytes; it is handed out
    once. `ROLLOUT_ENGINE_KV_SEND_DELAY_S` (test-only) sleeps before each chunk."""
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


class GrpcFetcher:
    """Decode side of the "grpc" transport: pulls a handle's KV from the prefill server it
    names. One channel per address, reused."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def __call__(self, params: KVTransferParams, deadline: float) -> torch.Tensor:
        stub = pb_grpc.RolloutEngineStub(self._channel(params.location))
        timeout = max(deadline - time.monotonic(), 0.001)
        try:
            responses = stub.PullKV(pb.PullKVRequest(transfer_id=params.transfer_id),
                                    timeout=timeout)
            header = next(responses)
            data = bytearray()
            for message in responses:
                data += message.data
        except grpc.RpcError as exc:
            raise KVTransferFailed(
                f"pulling KV from {params.location} failed: {exc.code().name}: {exc.details()}"
            ) from None
        except StopIteration:
            raise KVTransferFailed(f"{params.location} sent no KV") from None
        dtype = getattr(torch, header.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KVTransferFailed(f"{params.location} sent KV of unknown dtype {header.dtype!r}")
        if not data:
            return torch.empty(0, dtype=dtype).view(tuple(header.shape))
        return torch.frombuffer(data, dtype=dtype).view(tuple(header.shape))

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address, options=[
                    ("grpc.max_receive_message_length", self._max_message_bytes),
                ])
            return channel


def fetch_cuda_ipc(params: KVTransferParams, deadline: float) -> torch.Tensor:
    """Decode side of the "cuda_ipc" transport: a private copy of the prefill engine's CUDA
    tensor (raw bytes), on this process's view of the same GPU."""
    from rollout_engine.server.weights import open_cuda_ipc_buffer

    try:
        shared = open_cuda_ipc_buffer(pb.CudaIpcHandle(**cuda_ipc_descriptor_of(params)))
    except Exception as exc:
        raise KVTransferFailed(f"opening the CUDA IPC handle failed: {exc}") from exc
    copy = shared.clone()
    torch.cuda.current_stream(copy.device).synchronize()
    return copy
