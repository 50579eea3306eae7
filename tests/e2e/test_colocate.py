"""A hand-written RL loop colocated with a real engine server through `Colocation`: the
choreography, the memory timeline, and the combined peak that sleeping lowers."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_engine.tiny_model import build_tiny_model
from trainer_bridge import EngineClient, EngineSleepingError, SamplingParams
from trainer_bridge.colocate import Colocation
from trainer_bridge.server_process import EngineServer
from trainer_bridge.timeline import MemoryTimeline, plot_timeline, summarize

MiB = 2**20
KV_CACHE_MIB = 256
NUM_PROMPTS, NUM_GENERATIONS, NUM_TOKENS = 8, 8, 56
PROMPTS = [[3 + i, 14, 15, 92, 65, 35, 89, 79] for i in range(NUM_PROMPTS)]
DIGITS = torch.arange(17, 27)  # the tiny tokenizer's "0".."9"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Tiny, but with an 8192-token vocabulary: the trainer's logits and their gradients
    ([64 completions, 48 positions, 8192] floats) outweigh the engine's pools."""
    return build_tiny_model(tmp_path_factory.mktemp("colocate") / "model", "llama", "tiny",
                            seed=0, vocab_size=8192)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("colocate-server") / "server.log"
    with EngineServer(model_dir, engine_options={"kv_cache_bytes": f"{KV_CACHE_MIB}MiB"},
                      log_path=log_path) as engine_server:
        yield engine_server


def reinforce_step(model, optimizer, outputs) -> float:
    """One policy-gradient step on the rollouts: reward = fraction of digit tokens, advantage
    = reward minus its group's mean. Returns the mean reward."""
    sequences, advantages, rewards = [], [], []
    for output in outputs:
        group = [torch.isin(torch.tensor(c.token_ids), DIGITS).float().mean() for c in output.outputs]
        mean = torch.stack(group).mean()
        for completion, reward in zip(output.outputs, group, strict=True):
            sequences.append(output.prompt_token_ids + completion.token_ids)
            advantages.append(reward - mean)
            rewards.append(reward)
    input_ids = torch.tensor(sequences)  # [num_sequences, prompt + completion]
    num_prompt = len(PROMPTS[0])
    logits = model(input_ids).logits[:, num_prompt - 1 : -1]  # [num_sequences, completion, vocab]
    logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, num_prompt:, None]).squeeze(-1)
    loss = -(torch.stack(advantages)[:, None] * logprobs).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(torch.stack(rewards).mean())


def run_loop(server: EngineServer, model_dir, sleep_level: int | None, num_steps: int = 2):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = SamplingParams(n=NUM_GENERATIONS, max_tokens=NUM_TOKENS, ignore_eos=True)
    timeline = MemoryTimeline({"trainer": os.getpid(), "engine": server.pid}, hz=100)
    with EngineClient(server.address, timeout=120) as client, timeline:
        colocation = Colocation(client, sleep_level=sleep_level, timeline=timeline)
        versions = []
        for _ in range(num_steps):
            with colocation.rollout(weights=model) as engine:
                outputs = engine.generate(PROMPTS, params)
            versions.append({c.weight_version for o in outputs for c in o.outputs})
            with colocation.training():
                reinforce_step(model, optimizer, outputs)
        pool_bytes = client.memory_state().pool_bytes
        colocation.sync_weights(model)  # leave the engine awake for the next test
        colocation.wake_kv_cache()
    return timeline, versions, pool_bytes


def test_choreography_and_timeline(server, model_dir, tmp_path):
    with EngineClient(server.address, timeout=60) as client:
        first_version = client.info().weight_version
    timeline, versions, _ = run_loop(server, model_dir, sleep_level=2)
    # Each rollout generated with the weights pushed just before it.
    assert versions == [{first_version + 1}, {first_version + 2}]
    first = ["weight_sync", "reset_prefix_cache", "generate", "sleep", "train"]  # awake at start
    wake = ["wake_weights", "weight_sync", "reset_prefix_cache", "wake_kv_cache"]
    assert [p["name"] for p in timeline.phases] == [*first, *wake, *first[2:], *wake]
    summary = summarize(timeline.to_dict())
    assert summary["samples_per_s"] >= 20
    # Sleep level 2 hands the engine's weight and KV pools back: its memory drops by both.
    freed = summary["phases"]["sleep"]["median_freed_bytes"]["engine"]
    assert freed >= 0.9 * (KV_CACHE_MIB * MiB), freed / MiB
    plot_timeline(timeline.to_dict(), tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_level_2_needs_weights_before_generating(server):
    with EngineClient(server.address, timeout=60) as client:
        colocation = Colocation(client, sleep_level=2)
        colocation.sleep()
        with pytest.raises(ValueError, match="rollout\\(weights=model\\)"), colocation.rollout():
            pass
        with pytest.raises(EngineSleepingError):
            client.generate(PROMPTS[:1], SamplingParams(max_tokens=2))
        client.wake_up()  # the weights are zeros now; the next test pushes real ones


def test_sleeping_lowers_the_combined_peak_by_the_engine_pools(server, model_dir):
    off, _, pool_bytes = run_loop(server, model_dir, sleep_level=None)
    on, _, _ = run_loop(server, model_dir, sleep_level=2)
    engine_bytes = pool_bytes["weights"] + pool_bytes["kv_cache"]
    peak_off = summarize(off.to_dict())["combined_peak_bytes"]
    peak_on = summarize(on.to_dict())["combined_peak_bytes"]
    saved = peak_off - peak_on
    assert saved >= 0.9 * engine_bytes, (
        f"sleep saved {saved / MiB:.0f} MiB of the combined peak; pools {engine_bytes / MiB:.0f} MiB")


def test_engine_pid_found_from_its_port(server):
    """A trainer given only an address can still sample the engine's memory."""
    from trainer_bridge.timeline import pid_listening_on

    assert pid_listening_on(int(server.address.rsplit(":", 1)[1])) == server.pid
