"""Tensor-parallel sharding math: which slice of which checkpoint tensor each rank holds.

No process is started: models are built on the meta device for a given (rank, size).
"""

from __future__ import annotations

import pytest
import torch

from rollout_engine.protocol import WeightUpdateError
from rollout_engine.tiny_model import make_config
from rollout_engine.worker.models.decoder import DecoderForCausalLM
from rollout_engine.worker.models.tp_sharding import (
    ShardSpec,
    attention_shard,
    check_tensor_parallel,
    kv_head_range,
    split_evenly,
    vocab_shard,
)
from rollout_engine.worker.tp.tp_group import TPGroup
from rollout_engine.worker.weights.weight_update import plan_update, weight_targets

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"
}


def tiny_config(arch: str, **overrides):
    """The tiny preset's config, with the architecture name a saved checkpoint carries."""
    config = make_config(arch, "tiny", **overrides)
    config.architectures = [_ARCHITECTURES[arch]]
    return config


def meta_model(config, rank: int, size: int) -> DecoderForCausalLM:
    with torch.device("meta"):
        return DecoderForCausalLM(config, max_positions=8, tp=TPGroup(rank, size))


def test_split_evenly_gives_consecutive_equal_parts() -> None:
    parts = [split_evenly(128, 4, r, "x") for r in range(4)]
    assert parts == [(0, 32), (32, 32), (64, 32), (96, 32)]
    with pytest.raises(ValueError, match="does not divide intermediate_size"):
        split_evenly(130, 4, 0, "intermediate_size")


def test_kv_heads_are_split_when_there_are_enough() -> None:
    assert [kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_head_range(2, 2, r) for r in range(2)] == [(0, 1), (1, 1)]


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    # 2 KV heads over 4 ranks: ranks 0, 1 read head 0 and ranks 2, 3 head 1, which is where
    # their query heads (2 of 8 each, 4 per KV group) belong.
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    for rank in range(4):
        shard = attention_shard(8, 2, 4, rank)
        group_of_first_query = shard.q_start // (8 // 2)
        assert shard.kv_start == group_of_first_query
    with pytest.raises(ValueError, match="cannot be replicated evenly"):
        kv_head_range(2, 3, 0)


def test_vocab_shards_cover_the_vocabulary_with_a_padded_last_shard() -> None:
    shards = [vocab_shard(10, 3, r) for r in range(3)]
    assert [(s.start, s.size, s.num_rows) for s in shards] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]


def test_check_refuses_heads_that_do_not_split() -> None:
    config = tiny_config("llama")  # 4 heads, 2 KV heads, intermediate 128
    check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 4)  # KV heads replicated
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        check_tensor_parallel(config, 3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_rank_shapes_and_slices(arch: str) -> None:
    config = tiny_config(arch)  # hidden 64, 4 heads of 16, 2 KV heads, vocab 512
    specs = meta_model(config, rank=1, size=2).shard_specs()
    layer = "model.layers.0."
    assert specs[layer + "self_attn.q_proj.weight"] == ShardSpec((64, 64), 0, 32, 32)
    assert specs[layer + "self_attn.k_proj.weight"] == ShardSpec((32, 64), 0, 16, 16)
    assert specs[layer + "self_attn.o_proj.weight"] == ShardSpec((64, 64), 1, 32, 32)
    assert specs[layer + "mlp.up_proj.weight"] == ShardSpec((128, 64), 0, 64, 64)
    assert specs[layer + "mlp.down_proj.weight"] == ShardSpec((64, 128), 1, 64, 64)
    assert specs["model.embed_tokens.weight"] == ShardSpec((512, 64), 0, 256, 256)
    assert not specs[layer + "input_layernorm.weight"].is_sharded
    if arch == "qwen2":  # q/k/v biases follow their rows
        assert specs[layer + "self_attn.v_proj.bias"] == ShardSpec((32,), 0, 16, 16)
    if arch == "qwen3":  # per-head norms are whole on every rank
        assert specs[layer + "self_attn.q_norm.weight"] == ShardSpec((16,))
    params = dict(meta_model(config, rank=1, size=2).named_parameters())
    assert params[layer + "self_attn.k_proj.weight"].shape == (16, 64)
    assert params[layer + "mlp.down_proj.weight"].shape == (64, 64)


@pytest.mark.parametrize("size", [2, 4])
def test_shards_of_all_ranks_rebuild_every_tensor(size: int) -> None:
    config = tiny_config("llama", vocab_size=514)  # 514 = 4 * 129 - 2: padded
    per_rank = [meta_model(config, rank, size).shard_specs() for rank in range(size)]
    for name, spec in per_rank[0].items():
        full = torch.randn(spec.full_shape)
        parts = [specs[name].select(full) for specs in per_rank]
        if not spec.is_sharded:
            assert all(torch.equal(p, full) for p in parts)
        elif ("k_proj" in name or "v_proj" in name) and size > config.num_key_value_heads:
            replicas = size // config.num_key_value_heads  # ranks holding the same KV head
            assert torch.equal(torch.cat(parts[::replicas], spec.dim), full), name
        else:
            assert torch.equal(torch.cat(parts, spec.dim), full), name


def test_copy_into_zero_fills_the_padding() -> None:
    spec = ShardSpec((10, 3), 0, 8, 2)
    param = torch.full((4, 3), 7.0)
    full = torch.arange(30.0).view(10, 3)
    spec.copy_into(param, full)
    assert torch.equal(param[:2], full[8:]) and not param[2:].any()


def test_tp1_is_the_plain_model() -> None:
    config = tiny_config("qwen2")
    specs = meta_model(config, 0, 1).shard_specs()
    assert not any(s.is_sharded for s in specs.values())


def test_weight_update_manifest_is_checked_against_full_shapes() -> None:
    config = tiny_config("llama")
    model = meta_model(config, rank=0, size=2)
    params, aliases = weight_targets(model)
    specs = model.shard_specs()
    name = "model.layers.0.mlp.gate_proj.weight"
    plan = plan_update([(name, (128, 64), torch.float32)], params, aliases, None, specs)
    assert plan[name].shard == ShardSpec((128, 64), 0, 0, 64)
    refused = r"the update has shape \[64, 64\], the model has \[128, 64\]"
    with pytest.raises(WeightUpdateError, match=refused):
        plan_update([(name, (64, 64), torch.float32)], params, aliases, None, specs)
