"""Per-step description of a flattened, ragged batch for paged attention."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each request's queries sit in the flat batch and where its KV lives.

    Request i owns query rows `query_start_loc[i]:query_start_loc[i+1]`; its KV spans
    positions `[0, seq_lens[i])`, the last `query_lens[i]` of which are this step's tokens.
    Built once per step by the model runner and shared by every layer.
    """

    slot_mapping: torch.Tensor
    """[num_tokens] int64: flat KV slot (block_id * block_size + offset) of each new token."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] int32: prefix sums of query lengths."""
    seq_lens: torch.Tensor
    """[num_reqs] int32: KV length of each request including this step's tokens."""
    block_tables: torch.Tensor
    """[num_reqs, max_num_blocks] int32: block ids, padded with 0."""
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]] | None = None
    """The block tables as lists, when the builder had them (CPU planning). A list may hold
    more blocks than its request's `seq_lens` needs, and grow while the step runs (they are
    the requests' own tables): read the first ceil(seq_len / block_size) entries only."""
    cache: dict = field(default_factory=dict)
    """Per-step plans derived from the metadata (e.g. gather indices), built on first use."""

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From plain lists: one query length, KV length and block table per request."""
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_tables_cpu=[list(t) for t in block_tables],
        )
