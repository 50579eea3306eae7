"""What the AsyncGRPOTrainer tests share: the worker's tokenizer, a tap on the trainer's rollout
queue and TRL's tree attention as SDPA (its own is an FA3 kernel)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from tests.e2e.http_helpers import CHAT_TEMPLATE

# The worker parses each reply as an assistant message; with no template of the tokenizer's
# own to recognise, the whole reply is its content.
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"},
                     "fields": {"content": {"content": "text"}}}


def worker_tokenizer(model_dir):
    """The tokenizer TRL's rollout worker renders chats with and parses replies by."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


class TappedQueue:
    """The trainer's rollout queue, keeping a copy of each sample the trainer takes (`samples`)
    and of each one read off it while the worker stops (`drained`: made, not trained)."""

    def __init__(self, queue) -> None:
        self.queue = queue
        self.samples: list = []
        self.drained: list = []

    def get(self, *args, **kwargs):
        sample = self.queue.get(*args, **kwargs)
        self.samples.append(sample)
        return sample

    def qsize(self) -> int:
        return self.queue.qsize()

    def drain_while(self, stop: Callable[[], None]) -> Callable[[], None]:
        """`stop` (AsyncRolloutWorker.stop) with the queue read meanwhile: the child cannot
        exit while its queue's feeder thread waits on a full pipe (TRL then kills it 15 s
        later)."""

        def draining_stop() -> None:
            is_stopped = threading.Event()

            def drain() -> None:
                while not is_stopped.is_set():
                    with contextlib.suppress(queue.Empty):
                        self.drained.append(self.queue.get(timeout=0.1))

            drainer = threading.Thread(target=drain, daemon=True)
            drainer.start()
            try:
                stop()
            finally:
                is_stopped.set()
                drainer.join()

        return draining_stop


def sdpa_tree_attention(module, query, key, value, attention_mask, *, tree_kv_index,
                        tree_cu_seqlens_q, tree_cu_seqlens_k, scaling=None, **kwargs):
    """TRL's tree attention on the CPU: each segment's queries attend causally (aligned
    bottom-right, as flash-attention's varlen) to the K/V of its root-to-segment path."""
    q = query[0]  # [num_heads, num_tokens, head_dim]
    k = key[0].index_select(1, tree_kv_index)  # [num_kv_heads, num_path_tokens, head_dim]
    v = value[0].index_select(1, tree_kv_index)
    num_groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(num_groups, 0), v.repeat_interleave(num_groups, 0)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outputs = []
    for q_start, q_end, k_start, k_end in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        num_q, num_k = q_end - q_start, k_end - k_start
        mask = torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q)
        outputs.append(F.scaled_dot_product_attention(
            q[:, q_start:q_end], k[:, k_start:k_end], v[:, k_start:k_end], attn_mask=mask,
            scale=scaling))
    return torch.cat(outputs, dim=1).transpose(0, 1).unsqueeze(0), None
