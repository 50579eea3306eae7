"""LoRA adapters served unmerged: PEFT's own model is the oracle of every adapter's tokens
and logprobs, in batches that mix adapters and the base model, through both modeling
backends, with slots rotating, the prefix cache, preemption and async scheduling; bad
adapters are refused whole while the engine goes on serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_engine import LLM, LoRAError, LoRARequest, SamplingParams
from rollout_engine.tiny_model import write_model_dir
from tests.integration.hf_oracle import load_hf_model
from tests.integration.test_transformers_backend import CONFIGS, make_config
from tests.lora_adapters import load_peft, make_adapter, peft_greedy, peft_logprobs

MAX_TOKENS = 10
ADAPTERS = {  # name: (rank, target modules, extra LoraConfig fields)
    "qv": (4, ["q_proj", "v_proj"], {}),
    "all": (8, "all-linear", {}),
    "rs": (16, ["o_proj", "down_proj", "k_proj", "up_proj"],
           {"use_rslora": True, "lora_alpha": 4, "rank_pattern": {"down_proj": 2},
            "alpha_pattern": {"k_proj": 3}}),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    requests = {}
    for i, (name, (r, targets, extra)) in enumerate(ADAPTERS.items()):
        path = make_adapter(llama_dir, root / name, r=r, target_modules=targets, seed=i,
                            **{"lora_alpha": 2 * r, **extra})
        requests[name] = LoRARequest(name, i + 1, str(path))
    return requests


@pytest.fixture(scope="module")
def oracles(llama_dir, adapters) -> dict[str | None, torch.nn.Module]:
    models = {name: load_peft(llama_dir, req.lora_path) for name, req in adapters.items()}
    models[None] = load_hf_model(str(llama_dir))
    return models


def prompts_and_loras(adapters, num_prompts: int = 8, length: int = 5):
    names = [*adapters, None]
    prompts = [[1 + (7 * i + j) % 400 for j in range(length)] for i in range(num_prompts)]
    loras = [None if names[i % len(names)] is None else adapters[names[i % len(names)]]
             for i in range(num_prompts)]
    return prompts, loras


def check_against_peft(outputs, prompts, loras, oracles) -> None:
    """Greedy tokens equal PEFT's; logprobs within 1e-5 + 1e-5 * |logprob| (the largest seen:
    1.2e-5 at a logprob of -3.8, 3e-6 of it: fp32 sums in another order)."""
    for prompt, lora, output in zip(prompts, loras, outputs):
        oracle = oracles[None if lora is None else lora.lora_name]
        completion = output.outputs[0]
        name = None if lora is None else lora.lora_name
        assert list(completion.token_ids) == peft_greedy(oracle, prompt, MAX_TOKENS), name
        expected = peft_logprobs(oracle, prompt, list(completion.token_ids))
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected,
                                   atol=1e-5, rtol=1e-5)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, ignore_eos=True)


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_mixed_batch_matches_peft(llama_dir, adapters, oracles, model_impl):
    """Three adapters (ranks 4, 8 and 16 with rsLoRA and per-module patterns) and the base in
    one batch, with two slots: every prompt's greedy tokens are PEFT's, logprobs within 1e-5."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16,
              model_impl=model_impl)
    prompts, loras = prompts_and_loras(adapters)
    outputs = llm.generate(prompts, GREEDY, lora_request=loras)
    check_against_peft(outputs, prompts, loras, oracles)
    assert llm.engine.list_loras() == {1, 2, 3}
    assert llm.engine.worker.lora.num_slot_loads >= 3  # two slots, three adapters: rotated


@pytest.mark.parametrize("options", [
    {"num_blocks": 12, "block_size": 4, "max_num_seqs": 8},  # preempts
    {"async_scheduling": True},
    {"max_num_batched_tokens": 8},  # chunked prefill
], ids=["preempting", "async", "chunked"])
def test_scheduling_modes_keep_adapters(llama_dir, adapters, oracles, options):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=3, **options)
    prompts, loras = prompts_and_loras(adapters, length=14)
    outputs = llm.generate(prompts, GREEDY, lora_request=loras)
    check_against_peft(outputs, prompts, loras, oracles)
    if "num_blocks" in options:
        assert llm.stats()["num_preemptions"] > 0


def test_prefix_cache_is_per_adapter(llama_dir, adapters, oracles):
    """The same long prompt under the base, then an adapter, then each again: each run gets
    its own model's tokens, hits only its own adapter's KV, and repeats do hit."""
    llm = LLM(str(llama_dir), enable_lora=True, block_size=4)
    prompt = [3 + (5 * j) % 300 for j in range(21)]
    order = [(None, 0), (adapters["all"], 0), (None, 20), (adapters["all"], 20),
             (adapters["qv"], 0)]
    for lora, num_cached in order:
        outputs = llm.generate([prompt], GREEDY, lora_request=lora)
        check_against_peft(outputs, [prompt], [lora], oracles)
        assert outputs[0].num_cached_tokens == num_cached


def test_host_copies_are_bounded_and_read_again(llama_dir, adapters, oracles):
    """max_cpu_loras 1: each adapter asked for after another is read again from its path."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_cpu_loras=1)
    for name in ["qv", "all", "qv"]:
        prompts, _ = prompts_and_loras(adapters, num_prompts=2)
        loras = [adapters[name]] * 2
        check_against_peft(llm.generate(prompts, GREEDY, lora_request=loras), prompts, loras,
                           oracles)
        assert len(llm.engine.worker.lora.adapters) == 1
    assert llm.engine.list_loras() == {1, 2}


def test_remove_and_reload_under_the_same_id(llama_dir, adapters, oracles):
    """An id removed and loaded again with other weights serves the new ones (no KV of the
    old ones from the prefix cache)."""
    llm = LLM(str(llama_dir), enable_lora=True, block_size=4)
    prompt = [3 + (5 * j) % 300 for j in range(21)]
    first = LoRARequest("policy", 7, adapters["qv"].lora_path)
    second = LoRARequest("policy", 7, adapters["all"].lora_path)
    outputs = llm.generate([prompt], GREEDY, lora_request=first)
    check_against_peft(outputs, [prompt], [adapters["qv"]], oracles)
    with pytest.raises(LoRAError, match="in use"):
        llm.generate([prompt], GREEDY, lora_request=second)
    assert llm.engine.remove_lora(7) is True
    assert llm.engine.remove_lora(7) is False
    outputs = llm.generate([prompt], GREEDY, lora_request=second)
    check_against_peft(outputs, [prompt], [adapters["all"]], oracles)


def test_removed_or_replaced_adapters_finish_their_requests(llama_dir, adapters, oracles):
    """Removing an adapter, or loading another in place under its name and id, while requests
    run under it: they finish under the old weights, new ones get the new, and the old weights
    leave the worker once nothing runs on them. A refused replacement leaves the old serving."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2)
    engine, prompt = llm.engine, [1, 2, 3, 4, 5]
    first = LoRARequest("policy", 3, adapters["qv"].lora_path)
    engine.add_request("old", prompt, GREEDY, lora_request=first)
    engine.step()  # its prefill ran under the old weights
    assert engine.loras.add_named("policy", adapters["all"].lora_path, load_inplace=True)
    with pytest.raises(LoRAError, match="not a directory"):
        engine.loras.add_named("policy", "/nowhere", load_inplace=True)
    second = engine.loras.by_name("policy")
    engine.add_request("new", prompt, GREEDY, lora_request=second)
    assert len(engine.worker.lora.adapters) == 2
    assert engine.remove_lora(3) is True  # both requests still run
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    check_against_peft([outputs["old"], outputs["new"]], [prompt, prompt],
                       [adapters["qv"], adapters["all"]], oracles)
    assert engine.list_loras() == set()
    engine.loras.add(adapters["rs"])  # any registry call drops what nothing runs on
    assert len(engine.worker.lora.adapters) == 1


def _copy_adapter(source: str, target: Path, config_changes=None, tensor_changes=None) -> str:
    target.mkdir()
    config = json.loads((Path(source) / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (target / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(Path(source) / "adapter_model.safetensors"))
    if tensor_changes:
        tensors = tensor_changes(tensors)
    save_file(tensors, str(target / "adapter_model.safetensors"))
    return str(target)


def _first_a_widened(tensors):
    name = next(n for n in tensors if "lora_A" in n)
    tensors[name] = torch.cat([tensors[name], tensors[name]], dim=1)
    return tensors


def _embedding_added(tensors):
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(4, 512)
    tensors["base_model.model.model.embed_tokens.lora_B.weight"] = torch.zeros(64, 4)
    return tensors


def _b_dropped(tensors):
    name = next(n for n in tensors if "lora_B" in n)
    del tensors[name]
    return tensors


BAD_ADAPTERS = {
    "dora": ({"use_dora": True}, None, "DoRA"),
    "bias": ({"bias": "lora_only"}, None, "biases"),
    "saved modules": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "wrong shape": (None, _first_a_widened, "do not fit"),
    "embedding": (None, _embedding_added, "not a linear layer"),
    "missing B": (None, _b_dropped, "no lora_B"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapters_are_refused_and_the_engine_serves_on(tmp_path, llama_dir, adapters,
                                                           oracles, case):
    config_changes, tensor_changes, message = BAD_ADAPTERS[case]
    path = _copy_adapter(adapters["all"].lora_path, tmp_path / "bad", config_changes,
                         tensor_changes)
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2)
    prompts, loras = prompts_and_loras(adapters, num_prompts=4)
    with pytest.raises(LoRAError, match=message):
        llm.generate(prompts, GREEDY, lora_request=[LoRARequest("bad", 9, path)] * 4)
    assert llm.engine.list_loras() == set()
    check_against_peft(llm.generate(prompts, GREEDY, lora_request=loras), prompts, loras,
                       oracles)


def test_refusals(tmp_path, llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAError, match="max_lora_rank"):
        llm.engine.add_lora(adapters["rs"])
    with pytest.raises(LoRAError, match="not a directory"):
        llm.engine.add_lora(LoRARequest("missing", 5, str(tmp_path / "nowhere")))
    assert llm.engine.add_lora(adapters["qv"]) is True
    assert llm.engine.add_lora(adapters["qv"]) is False  # loaded already
    with pytest.raises(LoRAError, match="in use"):
        llm.engine.add_lora(LoRARequest("qv", 6, adapters["all"].lora_path))
    with pytest.raises(LoRAError, match="one per prompt"):
        llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[adapters["qv"]])
    for bad in [("", 1), ("x", 0), ("x", True)]:
        with pytest.raises(LoRAError):
            LoRARequest(*bad)
    plain = LLM(str(llama_dir))
    with pytest.raises(LoRAError, match="enable_lora"):
        plain.generate([[1, 2]], GREEDY, lora_request=adapters["qv"])
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(llama_dir), enable_lora=True, batch_invariant=True)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_moe_adapters_on_experts_and_attention(tmp_path):
    check_moe_adapters(tmp_path)


def check_moe_adapters(tmp_path: Path, **llm_options) -> None:
    """A Qwen3-MoE through the transformers backend with three PEFT adapters, two of them on
    its experts (`target_parameters`: one with attention and both expert parameters, one with
    rsLoRA on down only), and the base in one batch with two slots: PEFT's tokens and logprobs;
    each adapter changes some prompt's tokens."""
    model_dir = write_model_dir(tmp_path / "moe", make_config(*CONFIGS["qwen3_moe"]))
    adapters = {
        "experts": make_adapter(model_dir, tmp_path / "experts", r=4, seed=1,
                                target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
        "down": make_adapter(model_dir, tmp_path / "down", r=8, seed=2, target_modules=[],
                             target_parameters=EXPERTS[1:], use_rslora=True, scale=0.3),
        "attn": make_adapter(model_dir, tmp_path / "attn", r=2, seed=3,
                             target_modules=["k_proj", "o_proj"]),
    }
    oracle = {name: load_peft(model_dir, path) for name, path in adapters.items()}
    oracle[None] = load_hf_model(str(model_dir))
    llm = LLM(str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **llm_options)
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}
    prompts = [[1 + (5 * i + j) % 300 for j in range(4 + i % 3)] for i in range(8)]
    loras = [*requests.values(), None] * 2
    try:
        outputs = llm.generate(prompts, GREEDY, lora_request=loras)
        base = llm.generate(prompts, GREEDY)
    finally:
        llm.shutdown()
    check_against_peft(outputs, prompts, loras, oracle)
    for lora in requests.values():  # control: each adapter changes some prompt's tokens
        assert any(out.outputs[0].token_ids != ref.outputs[0].token_ids
                   for out, ref, used in zip(outputs, base, loras) if used is lora)


@pytest.mark.parametrize("level", [1, 2])
def test_adapter_slots_sleep_and_wake_with_the_weights(llama_dir, adapters, oracles, level):
    """The slots' `lora` pool is released by every sleep and mapped again with the weights;
    the adapters come back from their host copies and serve as before."""
    from rollout_engine.protocol import LORA_TAG

    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2)
    prompts, loras = prompts_and_loras(adapters, num_prompts=4)
    check_against_peft(llm.generate(prompts, GREEDY, lora_request=loras), prompts, loras, oracles)
    state = llm.engine.memory_state().tags[LORA_TAG]
    assert state.mapped and state.num_bytes >= llm.engine.worker.lora.num_bytes
    llm.sleep(level)
    assert not llm.engine.memory_state().tags[LORA_TAG].mapped
    llm.wake_up(["weights"])
    assert llm.engine.memory_state().tags[LORA_TAG].mapped
    if level == 2:  # the base weights were discarded: put them back
        from safetensors.torch import load_file

        llm.update_weights(list(load_file(str(llama_dir / "model.safetensors")).items()))
    llm.wake_up(["kv_cache"])
    check_against_peft(llm.generate(prompts, GREEDY, lora_request=loras), prompts, loras, oracles)
