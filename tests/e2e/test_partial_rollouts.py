"""Partial rollouts through a real server: a step returns the first whole groups to finish,
the long ones run on across training phases (the engine sleeps in "keep" mode) and come back
once complete, their tokens from the old policy then the new one."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.e2e.server_process import start_server
from tests.integration.hf_oracle import hf_greedy
from trainer_bridge import EngineClient, SamplingParams
from trainer_bridge.colocate import Colocation
from trainer_bridge.partial_rollouts import PartialRollouts

SHORT, LONG = 6, 120  # new tokens of the quick groups and of the long tail


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(n=2, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir)
    yield process
    process.stop()


def test_long_groups_run_through_training_and_return_with_both_versions(
    server, llama_dir, other_model_dirs
):
    new_dir = other_model_dirs[1]
    prompts = [("long-a", [3, 14, 15, 92], greedy(LONG)), ("short-a", [27, 18, 28], greedy(SHORT)),
               ("long-b", [65, 35, 89, 79], greedy(LONG)), ("short-b", [11, 12], greedy(SHORT)),
               ("short-c", [40, 41, 42], greedy(SHORT)), ("short-d", [50, 51], greedy(SHORT))]
    with EngineClient(server.address, timeout=60) as client:
        colocation = Colocation(client, sleep_level=1, sleep_mode="keep")
        rollouts = PartialRollouts(client, iter(prompts), greedy(SHORT), oversample=2.0)
        with colocation.rollout():
            first = rollouts.collect(num_groups=2)
        # The two short groups of the first four started; the long ones run on, kept.
        assert {g.key for g in first.groups} == {"short-a", "short-b"}
        assert rollouts.num_in_flight == 2 and first.off_policy_token_fraction == 0.0
        assert client.memory_state().is_sleeping
        with colocation.training():
            new_weights = load_file(str(new_dir / "model.safetensors"))
        with colocation.rollout(weights=new_weights):
            second = rollouts.collect(num_groups=2)
        # The long groups are not waited for: the new short ones finish first.
        assert {g.key for g in second.groups} == {"short-c", "short-d"}
        assert second.num_carried_over == 0 and second.off_policy_token_fraction == 0.0
        with colocation.training():
            pass
        with colocation.rollout():
            third = rollouts.collect(num_groups=2)
        assert third.num_carried_over == 2
        assert {g.key for g in third.groups} == {"long-a", "long-b"}
        assert 0.0 < third.off_policy_token_fraction < 1.0
        for group in third.groups:
            prompt = {k: p for k, p, _ in prompts}[group.key]
            for completion in group.output.outputs:
                old, new = completion.weight_versions
                assert (old.version, new.version) == (0, 1) and new.end == LONG
                tokens = completion.token_ids
                assert tokens[: old.end] == hf_greedy(str(llama_dir), prompt, old.end)
                assert tokens[old.end :] == hf_greedy(str(new_dir), prompt + tokens[: old.end],
                                                      LONG - old.end)
        # Back to the checkpoint's weights for the other tests of the session.
        colocation.sync_weights(load_file(str(llama_dir / "model.safetensors")))
        rollouts.collect(num_groups=10)  # drain what is left
        assert rollouts.num_in_flight == 0
        assert client.info().num_free_blocks == client.info().num_blocks


def test_a_group_older_than_max_staleness_restarts_with_the_new_weights(
    server, llama_dir, other_model_dirs
):
    """max_staleness=1: a long group may cross one training phase, not two; at the third
    collect it is cancelled on the engine (its blocks freed) and its prompt starts anew, so
    what comes back was sampled by one policy only."""
    new_dir = other_model_dirs[1]
    long_prompt = [3, 14, 15, 92]
    prompts = [("long", long_prompt, greedy(LONG)), ("short-a", [27, 18, 28], greedy(SHORT)),
               ("short-b", [11, 12], greedy(SHORT)), ("short-c", [40, 41, 42], greedy(SHORT))]
    with EngineClient(server.address, timeout=60) as client:
        colocation = Colocation(client, sleep_level=1, sleep_mode="keep")
        rollouts = PartialRollouts(client, iter(prompts), greedy(SHORT), oversample=2.0,
                                   max_staleness=1)
        keys = []
        for weights in (None, None, load_file(str(new_dir / "model.safetensors"))):
            with colocation.rollout(weights=weights):
                keys += [g.key for g in rollouts.collect(num_groups=1).groups]
            with colocation.training():
                pass
        assert keys == ["short-a", "short-b", "short-c"] and rollouts.num_restarted == 1
        with colocation.rollout():
            (restarted,) = rollouts.collect(num_groups=1).groups
        version = client.info().weight_version
        assert restarted.key == "long" and rollouts.num_in_flight == 0
        for completion in restarted.output.outputs:
            assert [(s.version, s.start, s.end) for s in completion.weight_versions] == [
                (version, 0, LONG)]
            assert completion.token_ids == hf_greedy(str(new_dir), long_prompt, LONG)
        assert client.info().num_unfinished_requests == 0
        assert client.info().num_free_blocks == client.info().num_blocks
        colocation.sync_weights(load_file(str(llama_dir / "model.safetensors")))
    with pytest.raises(ValueError, match="max_staleness"):
        PartialRollouts(client, iter(prompts), greedy(SHORT), max_staleness=-1)


def test_an_engine_that_never_sleeps_keeps_its_groups_across_the_push(
    server, llama_dir, other_model_dirs
):
    """Colocation(sleep_level=None, sleep_mode="keep"): the long group generates on through
    the training phase, the weight push pauses it ("keep") instead of being refused, and it
    goes on with the new weights from where it was."""
    new_dir = other_model_dirs[2]
    long_prompt, num_long = [3, 14, 15, 92], 200
    prompts = [("long", long_prompt, greedy(num_long)), ("short-a", [27, 18, 28], greedy(SHORT)),
               ("short-b", [11, 12], greedy(SHORT))]
    with EngineClient(server.address, timeout=60) as client:
        with pytest.raises(ValueError, match="sleep_mode='keep'"):
            Colocation(client, sleep_level=None).partial_rollouts(iter(prompts), greedy(SHORT))
        colocation = Colocation(client, sleep_level=None, sleep_mode="keep")
        rollouts = colocation.partial_rollouts(iter(prompts), greedy(SHORT), oversample=2.0)
        version = client.info().weight_version
        with colocation.rollout():
            assert [g.key for g in rollouts.collect(num_groups=1).groups] == ["short-a"]
        assert client.info().num_unfinished_requests == 1  # the long group, still generating
        with colocation.rollout(weights=load_file(str(new_dir / "model.safetensors"))):
            groups = rollouts.collect(num_groups=2).groups
        assert {g.key for g in groups} == {"long", "short-b"} and not client.is_paused()
        (long,) = [g for g in groups if g.key == "long"]
        for completion in long.output.outputs:
            old, new = completion.weight_versions
            assert (old.version, new.version, new.end) == (version, version + 1, num_long)
            tokens = completion.token_ids
            assert tokens[: old.end] == hf_greedy(str(llama_dir), long_prompt, old.end)
            assert tokens[old.end :] == hf_greedy(str(new_dir), long_prompt + tokens[: old.end],
                                                  num_long - old.end)
        colocation.sync_weights(load_file(str(llama_dir / "model.safetensors")))
