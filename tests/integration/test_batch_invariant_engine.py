"""The engine's side of batch invariance (`LLM(..., batch_invariant=True)`): every sampled
token's logprob equals, bit for bit, what a Hugging Face forward of prompt + completion computes
under `set_batch_invariant_mode()` (the trainer's side), however the engine got there: batched
with others, in prefill chunks of 16 or 64, from the prefix cache, after preemption, verified
from n-gram drafts, under async scheduling; under tensor parallelism a request alone equals it
in a batch. The oracle is `==`; without the mode the same comparisons fail (the controls)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_engine import LLM, SamplingParams
from rollout_engine.batch_invariant import packed_weights_bytes, set_batch_invariant_mode
from rollout_engine.tiny_model import build_tiny_model, write_model_dir
from tests.integration.test_spec_decode import repetitive_prompts
from tests.integration.test_transformers_backend import CONFIGS, make_config
from tests.unit.test_paged_attention_cpu import require_kernel

PROMPTS = repetitive_prompts(8, seed=3)  # repeats, so that n-gram drafts are proposed
PARAMS = SamplingParams(n=2, temperature=0.3, max_tokens=20, logprobs=0, seed=11,
                        ignore_eos=True)
SETTINGS = {
    "batched": {},
    "chunks of 16": {"max_num_batched_tokens": 16},
    "chunks of 64": {"max_num_batched_tokens": 64},
    "drafting": {"num_speculative_tokens": 3},
    "preempting": {"num_blocks": 24, "block_size": 4, "enable_prefix_caching": False},
    "async": {"async_scheduling": True},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    require_kernel()
    root = tmp_path_factory.mktemp("batch_invariant_engine")
    dirs = {arch: str(build_tiny_model(root / arch, arch, "tiny")) for arch in ("llama", "qwen3")}
    dirs["qwen3_moe"] = str(write_model_dir(root / "qwen3_moe",
                                            make_config(*CONFIGS["qwen3_moe"])))
    return dirs


def trainer_logprobs(model_dir: str, dtype: torch.dtype, prompt: list[int],
                     completion: list[int], temperature: float, invariant: bool = True
                     ) -> torch.Tensor:
    """What a trainer computes for the completion's tokens: a forward of prompt + completion,
    logits / temperature, log-softmax (TRL's recipe)."""
    model = _trainer_model(model_dir, dtype)
    ids = torch.tensor([prompt + completion])
    with set_batch_invariant_mode(invariant), torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


_models: dict[tuple[str, torch.dtype], torch.nn.Module] = {}


def _trainer_model(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    if (model_dir, dtype) not in _models:
        _models[model_dir, dtype] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa").eval()
    return _models[model_dir, dtype]


def samples_that_differ(model_dir: str, dtype: torch.dtype, outputs,
                        invariant: bool = True) -> int:
    differ = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        for sample in output.outputs:
            expected = trainer_logprobs(model_dir, dtype, prompt, list(sample.token_ids),
                                        PARAMS.temperature, invariant)
            differ += not torch.equal(torch.tensor(sample.logprobs), expected)
    return differ


def run(model_dir: str, dtype: str, model_impl: str, invariant: bool = True, **settings):
    llm = LLM(model_dir, dtype=dtype, model_impl=model_impl, batch_invariant=invariant,
              **settings)
    return llm, llm.generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def batched_tokens(model_dirs) -> list[list[list[int]]]:
    _, outputs = run(model_dirs["llama"], "float32", "native")
    return tokens_of(outputs)


def tokens_of(outputs) -> list[list[list[int]]]:
    return [[list(sample.token_ids) for sample in output.outputs] for output in outputs]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_logprob_is_the_trainers_however_the_engine_got_there(model_dirs, batched_tokens,
                                                                     setting):
    llm, outputs = run(model_dirs["llama"], "float32", "native", **SETTINGS[setting])
    stats = llm.stats()
    if setting == "drafting":
        assert stats["spec_num_drafts"] > 0
    if setting == "preempting":
        assert stats["num_preemptions"] > 0
    assert samples_that_differ(model_dirs["llama"], torch.float32, outputs) == 0
    assert tokens_of(outputs) == batched_tokens  # seeded: no near tie breaks another way


def test_a_prefix_hit_and_a_batch_of_64_change_nothing(model_dirs):
    llm, first = run(model_dirs["llama"], "float32", "native")
    again = llm.generate(PROMPTS, PARAMS)  # every prompt now hits the prefix cache
    assert all(o.num_cached_tokens > 0 for o in again)
    crowd = [[7 + i % 400, 9, 11 + i] for i in range(64)]
    crowded = llm.generate(PROMPTS + crowd, [PARAMS] * len(PROMPTS) + [SamplingParams(
        temperature=1.0, max_tokens=20, ignore_eos=True)] * 64)
    for outputs in (again, crowded[:len(PROMPTS)]):
        for alone, other in zip(first, outputs, strict=True):
            for a, b in zip(alone.outputs, other.outputs, strict=True):
                assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize(("family", "dtype", "model_impl"), [
    pytest.param("qwen3", "bfloat16", "native", marks=pytest.mark.slow),
    ("qwen3", "float32", "transformers"),
    pytest.param("qwen3_moe", "bfloat16", "transformers", marks=pytest.mark.slow),
])
def test_other_models_dtypes_and_backends(model_dirs, family, dtype, model_impl):
    _, outputs = run(model_dirs[family], dtype, model_impl, max_num_batched_tokens=16)
    assert samples_that_differ(model_dirs[family], getattr(torch, dtype), outputs) == 0


@pytest.mark.slow  # about 25 s: two ranks on two cores, one thread each
def test_under_tensor_parallelism_a_request_alone_equals_it_in_a_batch(model_dirs):
    """TP = 2 (two processes): each rank's partial dot products are invariant and their sum is
    taken in one order, so a request's logprobs are the same alone and among others (though
    not TP = 1's: the sum over ranks is another order)."""
    llm = LLM(model_dirs["llama"], batch_invariant=True, tensor_parallel_size=2, cpu_threads=1,
              kv_cache_bytes=4 << 20)
    try:
        alone = llm.generate(PROMPTS[:1], PARAMS)[0]
        crowd = [[7 + i % 400, 9, 11 + i] for i in range(31)]
        batched = llm.generate(PROMPTS[:1] + crowd, [PARAMS] + [SamplingParams(
            temperature=1.0, max_tokens=20, ignore_eos=True)] * 31)[0]
    finally:
        llm.shutdown()
    for a, b in zip(alone.outputs, batched.outputs, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_updated_weights_are_packed_again_and_sleep_frees_the_copies(model_dirs, tmp_path,
                                                                     model_impl):
    """The linear kernel keeps a packed copy of every weight between steps (the native
    decoder's q|k|v and gate|up fused, its own; the transformers backend's through the mode): a
    weight update must not leave the old copies in use (the updated engine equals one loaded
    from the new weights, bit for bit) and sleep gives their memory back."""
    other_dir = build_tiny_model(tmp_path / "other", "llama", "tiny", seed=1)
    llm, _ = run(model_dirs["llama"], "float32", model_impl)
    packed = llm.engine.worker.packed_weights
    assert (packed.num_bytes if model_impl == "native" else packed_weights_bytes()) > 0
    new_weights = AutoModelForCausalLM.from_pretrained(other_dir).state_dict()
    llm.update_weights(list(new_weights.items()))
    updated = llm.generate(PROMPTS, PARAMS)
    _, fresh = run(str(other_dir), "float32", model_impl)
    assert [[(s.token_ids, s.logprobs) for s in o.outputs] for o in updated] == [
        [(s.token_ids, s.logprobs) for s in o.outputs] for o in fresh]
    llm.sleep(level=2)
    assert packed_weights_bytes() == 0 and (packed is None or packed.num_bytes == 0)


def test_fusing_the_linears_changes_no_bit(model_dirs):
    """The native decoder's fused q|k|v and gate|up on the batch-invariant GEMM (and SiLU fused
    with the product) give the bits of its linears one by one through the mode."""
    fused_llm, fused = run(model_dirs["qwen3"], "bfloat16", "native")
    _, apart = run(model_dirs["qwen3"], "bfloat16", "native", cpu_packed_weights=False)
    assert fused_llm.engine.worker.packed_weights.invariant
    assert [[(s.token_ids, s.logprobs) for s in o.outputs] for o in fused] == [
        [(s.token_ids, s.logprobs) for s in o.outputs] for o in apart]


def test_without_the_mode_the_logprobs_are_only_close(model_dirs):
    """The control: the same comparison fails without batch invariance on either side."""
    _, outputs = run(model_dirs["llama"], "float32", "native", invariant=False)
    assert samples_that_differ(model_dirs["llama"], torch.float32, outputs,
                               invariant=False) > 0


def test_batch_invariance_is_refused_where_it_cannot_hold(model_dirs):
    with pytest.raises(ValueError, match="CUDA graphs"):
        LLM(model_dirs["llama"], batch_invariant=True, cuda_graphs=True)
