"""CUDA graphs for plain decode steps: one graph per batch-size bucket.

A decode step of a small model is dozens of tiny kernels per layer; launching them one by
one from Python costs more than running them. A CUDA graph records the launches once and
replays them with one call. The graph reads its inputs from static buffers, so each step
copies its inputs there, pads the batch up to the next bucket, replays, and keeps the
first rows of the output.

Padding rows are harmless by construction: they write their K/V into a scratch block no
request owns (the worker reserves it), have a KV length of 1, and their outputs are dropped.
The Triton kernels read every length from device memory, and their launch configuration is
fixed at capture time for the longest possible sequence, so one graph serves any context.

Graphs stay valid while the tensors they read keep their addresses. The pools do across
sleep and wake (virtual memory is kept, physical memory is remapped), and weight updates
copy in place; `addresses_unchanged` checks it, and the runner drops stale graphs.

Off the GPU the same padded, static-buffer path runs eagerly, without capture: that is what
the CPU tests check (greedy parity with the plain path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels import AttentionMetadata

if TYPE_CHECKING:
    from rollout_engine.worker.kv_cache_spec import PagedKVCache
    from rollout_engine.worker.models.registry import CausalLM

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_batch_size: int) -> tuple[int, ...]:
    """The default buckets up to `max_batch_size`, which is always one."""
    sizes = [b for b in DEFAULT_BUCKETS if b < max_batch_size]
    return (*sizes, max_batch_size)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, hidden_size], written by every replay


class DecodeGraphs:
    """Runs uniform decode steps (one sampled query token per request) from graphs.

    `scratch_block` is a KV block outside the scheduler's pool; `max_blocks_per_seq` bounds
    the block table width (max_model_len / block_size).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: PagedKVCache,
        block_size: int,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        scratch_block: int,
        capture: bool | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = buckets_up_to(max_batch_size)
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.capture = kv_caches.device.type == "cuda" if capture is None else capture
        device, size = kv_caches.device, self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full(
            (size,), scratch_block * block_size, dtype=torch.int64, device=device
        )
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.full(
            (size, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self._graphs: dict[int, _Graph] = {}
        self._pool = None
        self.num_steps = 0
        """Steps run through this path (replayed, or padded and run eagerly off the GPU)."""
        self._addresses = self._current_addresses()

    # ------------------------------------------------------------------ decisions
    def bucket_for(self, num_reqs: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= num_reqs:
                return bucket
        return None

    def can_run(self, num_reqs: int, block_table_width: int) -> bool:
        return (
            self.bucket_for(num_reqs) is not None
            and block_table_width <= self.block_tables.shape[1]
        )

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def _current_addresses(self) -> tuple[int, ...]:
        params = tuple(p.data_ptr() for p in self.model.parameters())
        return (self.kv_caches.data_ptr(), *params)

    def addresses_unchanged(self) -> bool:
        """False when the KV cache or a weight moved since capture (graphs would read stale
        memory): the runner then drops the graphs and captures again on demand."""
        return self._current_addresses() == self._addresses

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = None
        self._addresses = self._current_addresses()

    # ------------------------------------------------------------------ running
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The forward of a uniform decode batch: [num_reqs, hidden]."""
        num_reqs = metadata.num_reqs
        bucket = self.bucket_for(num_reqs)
        assert bucket is not None, f"no bucket holds {num_reqs} requests"
        width = metadata.block_tables.shape[1]
        self.num_steps += 1
        self.input_ids[:num_reqs].copy_(input_ids)
        self.positions[:num_reqs].copy_(positions)
        self.slot_mapping[:num_reqs].copy_(metadata.slot_mapping)
        self.slot_mapping[num_reqs:bucket].fill_(self.scratch_block * self.block_size)
        self.seq_lens[:num_reqs].copy_(metadata.seq_lens)
        self.seq_lens[num_reqs:bucket].fill_(1)
        self.block_tables[:num_reqs, :width].copy_(metadata.block_tables)
        self.block_tables[num_reqs:bucket, 0].fill_(self.scratch_block)
        if not self.capture:
            return self._forward(bucket, self._eager_metadata(metadata, bucket))[:num_reqs]
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = self._capture(bucket)
        graph.graph.replay()
        return graph.hidden[:num_reqs]

    def _forward(self, bucket: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, metadata
        )

    def _static_metadata(self, bucket: int, seq_lens: list[int],
                         block_tables: list[list[int]] | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            block_size=self.block_size,
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=block_tables,
        )

    def _eager_metadata(self, metadata: AttentionMetadata, bucket: int) -> AttentionMetadata:
        """The static buffers with this step's host-side lengths (CPU kernels plan on them)."""
        padding = bucket - metadata.num_reqs
        tables = None
        if metadata.block_tables_cpu is not None:
            tables = metadata.block_tables_cpu + [[self.scratch_block]] * padding
        return self._static_metadata(bucket, metadata.seq_lens_cpu + [1] * padding, tables)

    def _capture(self, bucket: int) -> _Graph:
        """Warm up (compiles the kernels) and record the forward of `bucket` rows.

        The host-side lengths say every row may be max_model_len long, so the kernels'
        launch configuration (KV splits) covers any context the replays will see.
        """
        metadata = self._static_metadata(bucket, [self.max_model_len] * bucket, None)
        saved = (self.slot_mapping.clone(), self.seq_lens.clone())
        self.slot_mapping[:bucket].fill_(self.scratch_block * self.block_size)
        self.seq_lens[:bucket].fill_(1)
        side = torch.cuda.Stream(device=self.kv_caches.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket, metadata)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = self._forward(bucket, metadata)
        self.slot_mapping.copy_(saved[0])
        self.seq_lens.copy_(saved[1])
        return _Graph(graph=graph, hidden=hidden)
