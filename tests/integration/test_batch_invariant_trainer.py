"""The trainer's side of batch invariance: under `set_batch_invariant_mode()` a Hugging Face
model's log-probabilities of a sequence have the same bits alone, inside a right-padded batch,
inside a left-padded one and with another thread count (the oracle is `==`). Without the mode
the same forward changes bits on this machine (the control). Gradients still flow."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_engine.batch_invariant import set_batch_invariant_mode
from rollout_engine.tiny_model import build_tiny_model, write_model_dir
from tests.integration.test_transformers_backend import CONFIGS, make_config
from tests.unit.test_paged_attention_cpu import require_kernel

LENGTHS = [40, 17, 64, 33, 50, 9, 64, 21]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    require_kernel()
    root = tmp_path_factory.mktemp("batch_invariant")
    dirs = {arch: str(build_tiny_model(root / arch, arch, "tiny")) for arch in ("llama", "qwen3")}
    dirs["llama-small"] = str(build_tiny_model(root / "llama-small", "llama", "small"))
    dirs["qwen3_moe"] = str(write_model_dir(root / "qwen3_moe",
                                            make_config(*CONFIGS["qwen3_moe"])))
    return dirs


def log_probs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per position, the log-softmax over the vocabulary (positions from the mask, as TRL)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits.float(), -1)


def padded(sequences: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        span = slice(0, len(sequence)) if side == "right" else slice(length - len(sequence), None)
        ids[row, span], mask[row, span] = sequence, 1
    return ids, mask


def positions_that_differ(model, sequences: list[torch.Tensor]) -> dict[str, int]:
    """Positions whose log-probabilities differ from the sequence's own forward, by padding."""
    alone = [log_probs(model, s[None], torch.ones(1, len(s), dtype=torch.long))[0]
             for s in sequences]
    differ = {}
    for side in ("right", "left"):
        ids, mask = padded(sequences, side)
        batch = log_probs(model, ids, mask)
        differ[side] = sum(
            int((batch[row][mask[row].bool()] != own).any(-1).sum())
            for row, own in enumerate(alone))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        differ["one thread"] = sum(
            int((log_probs(model, s[None], torch.ones(1, len(s), dtype=torch.long))[0] != own)
                .any(-1).sum()) for s, own in zip(sequences, alone, strict=True))
    finally:
        torch.set_num_threads(threads)
    return differ


def sequences_for(model) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(10, model.config.vocab_size, (n,), generator=generator)
            for n in LENGTHS]


@pytest.mark.parametrize(("family", "dtype"), [
    ("llama", torch.float32),
    ("qwen3_moe", torch.bfloat16),
    pytest.param("llama", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("qwen3", torch.float32, marks=pytest.mark.slow),
    pytest.param("qwen3", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", torch.float32, marks=pytest.mark.slow),
])
def test_a_sequence_has_the_same_bits_in_any_batch_padding_and_thread_count(
        model_dirs, family, dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    with set_batch_invariant_mode():
        differ = positions_that_differ(model, sequences_for(model))
    assert differ == {"right": 0, "left": 0, "one thread": 0}


def test_without_the_mode_the_same_forward_changes_bits(model_dirs):
    """The control: the check above can fail (this machine's BLAS and sdpa reduce by shape)."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama-small"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    sequences = sequences_for(model)
    with set_batch_invariant_mode():
        assert positions_that_differ(model, sequences)["right"] == 0
    assert positions_that_differ(model, sequences)["right"] > 0


def test_the_mode_keeps_the_forward_close_and_trains(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    ids, mask = padded(sequences_for(model)[:3], "right")
    plain = log_probs(model, ids, mask)
    with set_batch_invariant_mode():
        invariant = log_probs(model, ids, mask)
        loss = -model(ids, attention_mask=mask).logits.float().log_softmax(-1)[..., 5].mean()
        loss.backward()
    real = mask.bool()
    torch.testing.assert_close(invariant[real], plain[real], rtol=1e-4, atol=1e-4)
    with_mode = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    (-model(ids, attention_mask=mask).logits.float().log_softmax(-1)[..., 5].mean()).backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(with_mode[name], parameter.grad, rtol=1e-3, atol=1e-5,
                                   msg=name)
