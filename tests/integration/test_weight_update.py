"""In-process weight updates: validated whole before writing, versioned, refused when cut off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout_engine import (
    LLM,
    EngineBusyError,
    EngineSleepingError,
    SamplingParams,
    WeightUpdateError,
)
from rollout_engine.tiny_model import build_tiny_model
from tests.integration.hf_oracle import hf_greedy

PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 42], list(range(20, 52))]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


def checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def manifest_of(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory) -> Path:
    """The same architecture and tokenizer as `llama_dir`, with weights from another seed."""
    return build_tiny_model(tmp_path_factory.mktemp("other") / "llama", "llama", "tiny", seed=1)


@pytest.fixture
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), kv_cache_bytes=1 << 20)


@pytest.fixture
def reference(llm) -> list[list[int]]:
    return greedy_tokens(llm)


def test_update_to_another_model_matches_its_transformers_greedy_output(
    llm, reference, other_llama_dir
):
    assert llm.update_weights(checkpoint(other_llama_dir)) == 1
    assert llm.weight_version == 1
    outputs = llm.generate(PROMPTS, GREEDY)
    expected = [hf_greedy(str(other_llama_dir), prompt, MAX_TOKENS) for prompt in PROMPTS]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected != reference, "the other seed should change the greedy outputs"
    assert all(o.outputs[0].weight_version == 1 for o in outputs)
    assert llm.memory_state().weights_valid


def test_update_accepts_pairs_and_a_partial_update_of_valid_weights(llm, reference, llama_dir):
    original = checkpoint(llama_dir)
    scaled = original["model.norm.weight"] * 3.0
    assert llm.update_weights([("model.norm.weight", scaled)]) == 1
    assert torch.equal(llm.engine.worker.model_runner.model.model.norm.weight, scaled)
    assert llm.update_weights([("model.norm.weight", original["model.norm.weight"])]) == 2
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.outputs[0].weight_version == 2 for o in outputs)


def _unknown_name(tensors):
    tensors["model.layers.0.mlp.fused_proj.weight"] = torch.zeros(2, 2)
    return "unknown parameter name 'model.layers.0.mlp.fused_proj.weight'"


def _wrong_shape(tensors):
    tensors["model.norm.weight"] = torch.ones(65)
    return r"'model.norm.weight': the update has shape \[65\], the model has \[64\]"


def _wrong_dtype(tensors):
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].half()
    return "'model.layers.1.mlp.up_proj.weight': the update has dtype torch.float16, the model has torch.float32"


def _not_a_tensor(tensors):
    tensors["model.norm.weight"] = [1.0] * 64
    return r"\{name: tensor\} or \(name, tensor\) pairs"


@pytest.mark.parametrize("corrupt", [_unknown_name, _wrong_shape, _wrong_dtype, _not_a_tensor])
def test_a_bad_update_is_refused_whole_and_the_old_weights_keep_serving(
    llm, reference, other_llama_dir, corrupt
):
    tensors = checkpoint(other_llama_dir)  # valid new weights, except for one entry
    match = corrupt(tensors)
    before = {name: p.clone() for name, p in llm.engine.worker.model_runner.model.named_parameters()}
    with pytest.raises(WeightUpdateError, match=match):
        llm.update_weights(tensors)
    after = dict(llm.engine.worker.model_runner.model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before), "a byte was written"
    assert llm.weight_version == 0 and llm.memory_state().weights_valid
    assert greedy_tokens(llm) == reference


@pytest.mark.parametrize(
    "manifest, match",
    [
        ([], "manifest is empty"),
        ([("model.norm.weight", (64,), torch.float32)] * 2, "names 'model.norm.weight' more than once"),
        ([("model.norm.weight", 64, torch.float32)], r"must be \(name, shape, dtype\)"),
        ([("model.norm.weight", (64,), "float32")], r"must be \(str name, shape, torch.dtype\)"),
    ],
)
def test_malformed_manifests_are_refused(llm, reference, manifest, match):
    with pytest.raises(WeightUpdateError, match=match):
        llm.begin_weight_update(manifest)
    assert greedy_tokens(llm) == reference


def test_an_aborted_session_refuses_generation_until_a_full_update_lands(llm, reference, llama_dir):
    tensors = checkpoint(llama_dir)
    session = llm.begin_weight_update(manifest_of(tensors))
    for name, tensor in list(tensors.items())[: len(tensors) // 2]:
        session.write(name, tensor)
    session.abort()
    assert not llm.memory_state().weights_valid
    with pytest.raises(EngineSleepingError, match="update is in progress or was cut off"):
        llm.generate(PROMPTS, GREEDY)
    with pytest.raises(WeightUpdateError, match="must cover every parameter.*lacks"):
        llm.update_weights({"model.norm.weight": tensors["model.norm.weight"]})
    with pytest.raises(WeightUpdateError, match="session is closed"):
        session.write("model.norm.weight", tensors["model.norm.weight"])
    assert llm.update_weights(tensors) == 1
    assert greedy_tokens(llm) == reference


def test_finishing_with_tensors_missing_is_refused(llm, llama_dir):
    tensors = checkpoint(llama_dir)
    session = llm.begin_weight_update(manifest_of(tensors))
    session.write("model.norm.weight", tensors["model.norm.weight"])
    with pytest.raises(WeightUpdateError, match=f"incomplete: {len(tensors) - 1} of {len(tensors)}"):
        session.finish()
    assert not session.is_open and llm.weight_version == 0
    with pytest.raises(EngineSleepingError, match="cut off"):
        llm.generate(PROMPTS, GREEDY)


def test_session_writes_are_checked_against_the_manifest(llm, llama_dir):
    tensors = checkpoint(llama_dir)
    session = llm.begin_weight_update(manifest_of(tensors))
    norm = tensors["model.norm.weight"]
    with pytest.raises(WeightUpdateError, match="not in this update's manifest"):
        session.write("model.nope", norm)
    with pytest.raises(WeightUpdateError, match=r"got a \[64\] torch.float64 tensor"):
        session.write("model.norm.weight", norm.double())
    session.write("model.norm.weight", norm)
    with pytest.raises(WeightUpdateError, match="already written"):
        session.write("model.norm.weight", norm)
    for name, tensor in tensors.items():
        if name != "model.norm.weight":
            session.write(name, tensor)
    assert session.num_pending == 0 and session.finish() == 1


def test_a_new_session_supersedes_an_open_one(llm, reference, llama_dir):
    tensors = checkpoint(llama_dir)
    first = llm.begin_weight_update(manifest_of(tensors))
    with pytest.raises(WeightUpdateError, match="must cover every parameter"):
        llm.begin_weight_update([("model.norm.weight", (64,), torch.float32)])
    assert first.is_open, "a refused manifest changes nothing"
    second = llm.begin_weight_update(manifest_of(tensors))
    with pytest.raises(WeightUpdateError, match="superseded"):
        first.write("model.norm.weight", tensors["model.norm.weight"])
    for name, tensor in tensors.items():
        second.write(name, tensor)
    assert second.finish() == 1
    assert greedy_tokens(llm) == reference


def test_updates_are_refused_while_requests_generate_or_weights_sleep(llm, llama_dir):
    tensors = checkpoint(llama_dir)
    llm.engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusyError, match="1 requests are still generating"):
        llm.update_weights(tensors)
    llm.sleep(level=1, mode="wait")
    with pytest.raises(EngineSleepingError, match=r"call wake_up\(\['weights'\]\) before updating"):
        llm.update_weights(tensors)
    llm.wake_up(["weights"])
    assert llm.update_weights(tensors) == 1


def test_sleep_aborts_an_open_session(llm, llama_dir):
    tensors = checkpoint(llama_dir)
    session = llm.begin_weight_update(manifest_of(tensors))
    llm.sleep(level=1)
    assert not session.is_open
    llm.wake_up()
    assert llm.memory_state().tags["weights"].state == "discarded"
    with pytest.raises(WeightUpdateError, match=r"closed \(sleep\(\) released the weights\)"):
        session.write("model.norm.weight", tensors["model.norm.weight"])
    assert llm.update_weights(tensors) == 1


def test_tied_lm_head_is_an_alias_of_the_embedding(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen2"]), kv_cache_bytes=1 << 20)
    model = llm.engine.worker.model_runner.model
    assert model.tie_word_embeddings and "lm_head.weight" not in dict(model.named_parameters())
    reference = greedy_tokens(llm)
    embed = model.model.embed_tokens.weight.detach().clone()
    # Both names (a state_dict): the alias is checked and ignored, the embedding is written.
    llm.update_weights({"model.embed_tokens.weight": embed, "lm_head.weight": embed * 0})
    assert torch.equal(model.model.embed_tokens.weight, embed)
    # The alias alone writes the embedding.
    llm.update_weights({"lm_head.weight": embed * 2})
    assert torch.equal(model.model.embed_tokens.weight, embed * 2)
    with pytest.raises(WeightUpdateError, match="'lm_head.weight': the update has shape"):
        llm.update_weights({"lm_head.weight": embed[:-1]})
    assert llm.update_weights({"lm_head.weight": embed}) == 3
    assert greedy_tokens(llm) == reference


def test_update_timeline_events(llm, llama_dir):
    llm.update_weights(checkpoint(llama_dir))
    events = [e for e in llm.memory_events.events if e["event"] == "weight_update"]
    assert [e["phase"] for e in events] == ["begin", "end"]
    assert events[1]["weight_version"] == 1
    assert events[1]["num_bytes"] == sum(p.nbytes for p in llm.engine.worker.model_runner.model.parameters())
