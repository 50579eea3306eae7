"""Prefill–decode disaggregation with real engines in one process (transport "shm").

The oracle is twofold: the Hugging Face model's greedy tokens, and a single engine that
computes everything itself. A decode engine whose transferred KV were wrong, late or read
before it landed would differ from both.
"""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from rollout_engine import (
    LLM,
    InvalidRequestError,
    KVTransferError,
    KVTransferParams,
    SamplingParams,
)
from rollout_engine.core.request import Request
from rollout_engine.tiny_model import build_tiny_model
from tests.conftest import ARCHS
from tests.integration.hf_oracle import hf_greedy_batch

MAX_TOKENS = 10
SHM_DIR = "/dev/shm"


def make_prompts(num_prompts: int = 5, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(6, 45))] for _ in range(num_prompts)]


PROMPTS = make_prompts()


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def prefill(llm: LLM, prompts: list[list[int]]) -> list[KVTransferParams]:
    """Each prompt's handle from a prefill engine (max_tokens=1, as the router sends it)."""
    params = greedy(1, kv_transfer_params=KVTransferParams(do_remote_decode=True))
    handles = [o.outputs[0].kv_transfer_params for o in llm.generate(prompts, params)]
    assert all(h is not None and h.do_remote_prefill for h in handles)
    return handles


def decode(llm: LLM, prompts, handles, **kwargs) -> list[list[int]]:
    params = [greedy(kv_transfer_params=h, **kwargs) for h in handles]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def kv_files() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith("rollout-kv-")}


@pytest.fixture
def no_leaked_files():
    before = kv_files()
    yield
    assert kv_files() <= before, "a /dev/shm KV file outlived its transfer"


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_from_transferred_kv_equals_one_engine_and_transformers(
    tiny_model_dirs, arch, no_leaked_files
):
    model = str(tiny_model_dirs[arch])
    expected = hf_greedy_batch(model, PROMPTS, MAX_TOKENS)
    single = LLM(model, block_size=4)
    assert [o.outputs[0].token_ids for o in single.generate(PROMPTS, greedy())] == expected
    prefill_llm = LLM(model, block_size=4, kv_role="prefill")
    decode_llm = LLM(model, block_size=4, kv_role="decode")
    handles = prefill(prefill_llm, PROMPTS)
    assert decode(decode_llm, PROMPTS, handles) == expected
    stats = decode_llm.stats()
    # Every prompt position but the last came over the wire, none was a local cache hit.
    assert stats["kv_loaded_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    assert stats["kv_load_failures"] == 0 and stats["num_prefix_hit_tokens"] == 0
    assert stats["kv_loaded_bytes"] == prefill_llm.stats()["kv_saved_bytes"]
    assert decode_llm.info().num_free_blocks == decode_llm.info().num_blocks


def test_seeded_samples_of_a_group_equal_one_engines(tiny_model_dirs):
    model = str(tiny_model_dirs["qwen2"])
    params = {"n": 4, "temperature": 1.0, "top_p": 0.9, "max_tokens": MAX_TOKENS, "seed": 7,
              "ignore_eos": True}
    single = LLM(model, block_size=4)
    expected = [[c.token_ids for c in o.outputs]
                for o in single.generate(PROMPTS, SamplingParams(**params))]
    prefill_llm = LLM(model, block_size=4, kv_role="prefill", async_scheduling=True)
    decode_llm = LLM(model, block_size=4, kv_role="decode", async_scheduling=True)
    handles = prefill(prefill_llm, PROMPTS)
    outputs = decode_llm.generate(
        PROMPTS, [SamplingParams(**params, kv_transfer_params=h) for h in handles]
    )
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    stats = decode_llm.stats()
    assert stats["kv_loaded_tokens"] == sum(len(p) - 1 for p in PROMPTS)  # once per group


def test_a_prompt_sharing_the_prefix_during_a_delayed_transfer_computes_its_own(
    tiny_model_dirs, no_leaked_files
):
    """The transfer is held back on purpose; a request for the same prompt arrives while
    its blocks are allocated but empty (zero-filled). Hitting them would change its tokens."""
    model = str(tiny_model_dirs["llama"])
    prompt = PROMPTS[1]
    expected = hf_greedy_batch(model, [prompt], MAX_TOKENS)[0]
    prefill_llm = LLM(model, block_size=4, kv_role="prefill")  # its files live as long
    (handle,) = prefill(prefill_llm, [prompt])
    decode_llm = LLM(model, block_size=4, kv_role="decode")
    engine = decode_llm.engine
    engine.kv_transfer.fetch_gate = gate = threading.Event()  # the transfer waits for it
    engine.add_request("remote", prompt, greedy(kv_transfer_params=handle))
    engine.step()  # the transfer starts
    assert engine.scheduler.kv_connector.num_loading == 1
    engine.add_request("local", prompt, greedy())
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
                if output.request_id == "local":
                    assert engine.scheduler.kv_connector.num_loading == 1  # done before the transfer
                    gate.set()
    assert finished == {"remote": expected, "local": expected}
    stats = decode_llm.stats()
    assert stats["num_prefix_hit_tokens"] == 0 and stats["kv_loaded_tokens"] == len(prompt) - 1


@pytest.mark.parametrize("failure", ["timeout", "handle_used_twice"])
def test_a_failed_transfer_is_recomputed_with_the_same_tokens(tiny_model_dirs, failure):
    model = str(tiny_model_dirs["qwen3"])
    expected = hf_greedy_batch(model, PROMPTS[:2], MAX_TOKENS)
    prefill_llm = LLM(model, block_size=4, kv_role="prefill")
    handles = prefill(prefill_llm, PROMPTS[:2])
    decode_llm = LLM(model, block_size=4, kv_role="decode", kv_transfer_timeout_s=0.3)
    if failure == "timeout":
        decode_llm.engine.kv_transfer.fetch_delay_s = 1.0
    else:  # the first use consumes the /dev/shm file; the second finds it gone
        assert decode(decode_llm, PROMPTS[:2], handles) == expected
        decode_llm.reset_prefix_cache()
    assert decode(decode_llm, PROMPTS[:2], handles) == expected
    stats = decode_llm.stats()
    assert stats["kv_load_failures"] == 2
    assert decode_llm.info().num_free_blocks == decode_llm.info().num_blocks


def test_an_abort_or_a_sleep_during_the_transfer_drops_it_and_leaks_nothing(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    prefill_llm = LLM(model, block_size=4, kv_role="prefill")
    handles = prefill(prefill_llm, PROMPTS[:3])
    decode_llm = LLM(model, block_size=4, kv_role="decode")
    engine = decode_llm.engine
    engine.kv_transfer.fetch_delay_s = 0.3
    for i, handle in enumerate(handles):
        engine.add_request(str(i), PROMPTS[i], greedy(kv_transfer_params=handle))
    engine.step()
    assert engine.scheduler.kv_connector.num_loading == 3
    engine.abort_request("0")
    outputs = engine.sleep(level=1)  # aborts the other two
    assert sorted(o.request_id for o in outputs) == ["0", "1", "2"]
    assert all(o.outputs[0].finish_reason == "abort" for o in outputs)
    engine.wake_up()
    time.sleep(0.5)  # the transfers land now, for requests that are gone
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert engine.kv_transfer.num_loading == 0 and engine.scheduler.kv_connector.num_loading == 0
    assert engine.scheduler.num_free_blocks == engine.scheduler.num_blocks
    assert engine.stats()["kv_loaded_bytes"] == 0  # nothing was written for them
    expected = hf_greedy_batch(model, PROMPTS[:1], MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in decode_llm.generate(PROMPTS[:1], greedy())] == expected


def test_mismatched_handles_are_refused_with_a_clear_error(tiny_model_dirs, tmp_path):
    model = str(tiny_model_dirs["llama"])
    prefill_llm = LLM(model, block_size=4, kv_role="prefill")
    (handle,) = prefill(prefill_llm, PROMPTS[:1])
    prompt = PROMPTS[0]

    with pytest.raises(KVTransferError, match="kv-role"):
        LLM(model, block_size=4).generate([prompt], greedy(kv_transfer_params=handle))
    with pytest.raises(KVTransferError, match="only a prefill engine"):
        LLM(model, block_size=4, kv_role="decode").generate(
            [prompt], greedy(1, kv_transfer_params=KVTransferParams(do_remote_decode=True)))
    with pytest.raises(KVTransferError, match="layout"):
        LLM(model, block_size=8, kv_role="decode").generate(
            [prompt], greedy(kv_transfer_params=handle))
    with pytest.raises(KVTransferError, match="layout"):
        LLM(model, block_size=4, dtype="bfloat16", kv_role="decode").generate(
            [prompt], greedy(kv_transfer_params=handle))
    with pytest.raises(KVTransferError, match="layout"):
        LLM(str(tiny_model_dirs["qwen2"]), block_size=4, kv_role="decode").generate(
            [prompt], greedy(kv_transfer_params=handle))

    other_checkpoint = build_tiny_model(tmp_path / "llama-seed1", "llama", "tiny", seed=1)
    with pytest.raises(KVTransferError, match="other weights"):  # same shapes, other values
        LLM(str(other_checkpoint), block_size=4, kv_role="decode").generate(
            [prompt], greedy(kv_transfer_params=handle))

    decode_llm = LLM(model, block_size=4, kv_role="decode")
    with pytest.raises(KVTransferError, match="another prompt"):
        decode_llm.generate([PROMPTS[1]], greedy(kv_transfer_params=handle))
    weights = {n: p.detach().clone() for n, p in decode_llm.engine.worker.model_runner.model
               .named_parameters()}
    assert decode_llm.update_weights(list(weights.items())) == 1
    with pytest.raises(KVTransferError, match="weight version 0 but this engine has version 1"):
        decode_llm.generate([prompt], greedy(kv_transfer_params=handle))
    with pytest.raises(InvalidRequestError, match="n=1"):
        greedy(1, n=2, kv_transfer_params=KVTransferParams(do_remote_decode=True))
    with pytest.raises(InvalidRequestError, match="transport"):
        KVTransferParams(do_remote_prefill=True, transfer_id="x", transport="carrier-pigeon",
                         num_tokens=3)
    # A refused request left nothing behind; the engine serves the next one.
    assert decode_llm.info().num_free_blocks == decode_llm.info().num_blocks
    expected = hf_greedy_batch(model, [prompt], MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in decode_llm.generate([prompt], greedy())] == expected


def test_save_copies_exactly_the_prompt_kv_the_blocks_hold(tiny_model_dirs):
    """The saved tensor is the prompt's KV in token order, whatever the cache layout."""
    model = str(tiny_model_dirs["qwen2"])
    llm = LLM(model, block_size=4, kv_role="prefill", kv_transport="grpc")
    prompt = PROMPTS[2]
    (handle,) = prefill(llm, [prompt])
    saved = llm.engine.kv_transfer.store.pop(handle.transfer_id)
    kv = llm.engine.worker.model_runner.kv_caches
    num_layers, (_, _, num_kv_heads, head_dim) = len(kv), kv[0][0].shape
    # Per layer its keys, then its values, each [num_tokens, Hkv, D].
    saved = saved.view(num_layers, 2, len(prompt) - 1, num_kv_heads, head_dim)
    # The prefix cache still holds the prompt's full blocks: compare with them directly.
    probe = Request("probe", prompt, SamplingParams())
    blocks, num_hit_tokens = llm.engine.scheduler.kv_cache_manager.get_computed_blocks(probe)
    assert num_hit_tokens == (len(prompt) - 1) // 4 * 4 > 0
    for i, block in enumerate(blocks):
        for layer, caches in enumerate(kv):
            for k_or_v, cache in enumerate(caches):
                torch.testing.assert_close(saved[layer, k_or_v, i * 4 : (i + 1) * 4],
                                           cache[block.block_id], rtol=0, atol=0)


def test_an_idle_prefill_engine_unlinks_expired_handles(tiny_model_dirs, no_leaked_files):
    """Nothing happens after the save (no other save, no pull): the /dev/shm file still goes
    once its time to live ends. Before the fix it stayed until the next save or pull."""
    ttl_s = 0.3
    llm = LLM(str(tiny_model_dirs["llama"]), block_size=4, kv_role="prefill",
              kv_handle_ttl_s=ttl_s)
    try:
        saved_before = time.monotonic()
        (handle,) = prefill(llm, [PROMPTS[0]])
        path = os.path.join(SHM_DIR, handle.location)
        assert os.path.exists(path)
        deadline = saved_before + ttl_s + 2.0
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(path), f"{path} outlived its {ttl_s} s time to live"
        assert time.monotonic() - saved_before >= ttl_s, "unlinked before its time to live"
        assert llm.engine.kv_transfer.store.num_entries == 0
    finally:
        llm.shutdown()
