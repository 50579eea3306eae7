"""Tests of the random-weight model builder and the `make-tiny-model` command."""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rollout_engine import tiny_model
from rollout_engine.cli import main
from rollout_engine.tiny_model import (
    ARCHITECTURES,
    BOS_TOKEN,
    EOS_TOKEN,
    LLAMA3_ROPE_SCALING,
    SIZES,
    build_tiny_model,
    build_tokenizer,
)

TINY = SIZES["tiny"]
TEXTS = [
    "The people said the water was hot.",
    "Hello, world! 1234 + 56 = 1290?",
    "  leading spaces\n\nnew lines\ttabs  ",
    "ünïcode café naïve 🙂 日本語",
    "It's they'll we've, $HELLO_world IT'S\r\n  x",
    "cafe\u0301 (decomposed: the normalizer composes it)",
    "",
]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs: dict[str, Path]) -> dict[str, Path]:
    """The session's tiny models: one per architecture, default arguments, seed 0."""
    return tiny_model_dirs


def file_digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


def load_model(directory: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_with_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    model = load_model(model_dirs[arch])
    config = model.config
    assert config.model_type == arch
    for key, value in TINY.items():
        assert getattr(config, key) == value, key
    assert model.dtype == torch.float32
    assert (model_dirs[arch] / "model.safetensors").is_file()
    num_params = sum(p.numel() for p in model.parameters())
    assert 50_000 < num_params < 2_000_000, num_params

    tokenizer = AutoTokenizer.from_pretrained(model_dirs[arch])
    generation_config = GenerationConfig.from_pretrained(model_dirs[arch])
    assert generation_config.eos_token_id == tokenizer.eos_token_id == config.eos_token_id
    assert generation_config.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    assert generation_config.bos_token_id == tokenizer.bos_token_id == config.bos_token_id


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_same_arguments_write_identical_files(arch: str, tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "first", arch, seed=5)
    second = build_tiny_model(tmp_path / "second", arch, seed=5)
    assert file_digests(first) == file_digests(second)


def test_seed_changes_weights_only(tmp_path: Path) -> None:
    other = file_digests(build_tiny_model(tmp_path / "seed1", "llama", seed=1))
    reference = file_digests(build_tiny_model(tmp_path / "seed0", "llama", seed=0))
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert other["tokenizer.json"] == reference["tokenizer.json"]
    assert other["config.json"] == reference["config.json"]


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", "qwen3")
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize(
    ("arch", "override", "expect_tied"),
    [
        ("llama", None, False),
        ("qwen2", None, True),
        ("qwen3", None, True),
        ("llama", True, True),
        ("qwen2", False, False),
    ],
)
def test_tied_embeddings(
    model_dirs: dict[str, Path],
    tmp_path: Path,
    arch: str,
    override: bool | None,
    expect_tied: bool,
) -> None:
    if override is None:
        directory = model_dirs[arch]
    else:
        directory = build_tiny_model(tmp_path / "m", arch, tie_word_embeddings=override)
    model = load_model(directory)
    assert model.config.tie_word_embeddings is expect_tied
    embedding = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    assert torch.equal(embedding, lm_head) is expect_tied


def test_qwen2_has_nonzero_qkv_bias(model_dirs: dict[str, Path]) -> None:
    attention = load_model(model_dirs["qwen2"]).model.layers[0].self_attn
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert proj.bias is not None and proj.bias.abs().max() > 0.01
    assert attention.o_proj.bias is None
    assert load_model(model_dirs["llama"]).model.layers[0].self_attn.q_proj.bias is None


def test_qwen3_has_qk_norm_and_explicit_head_dim(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["qwen3"])
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    assert model.config.head_dim == head_dim
    attention = model.model.layers[0].self_attn
    for norm in (attention.q_norm, attention.k_norm):
        assert norm.weight.shape == (head_dim,)
        # Not all ones: an implementation that skips the norm weight gives other tokens.
        assert (norm.weight - 1.0).abs().max() > 0.01
    assert not hasattr(load_model(model_dirs["llama"]).model.layers[0].self_attn, "q_norm")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_no_sliding_window(model_dirs: dict[str, Path], arch: str) -> None:
    config = AutoConfig.from_pretrained(model_dirs[arch])
    assert getattr(config, "sliding_window", None) is None
    assert all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or [])


def rope_config(config: object) -> dict:
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(parameters or {})


def test_llama3_rope_scaling_is_loaded_and_used(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    directory = build_tiny_model(tmp_path / "m", "llama", rope_scaling=dict(LLAMA3_ROPE_SCALING))
    config = AutoConfig.from_pretrained(directory)
    rope = rope_config(config)
    assert rope["rope_type"] == "llama3"
    for key, value in LLAMA3_ROPE_SCALING.items():
        assert rope[key] == value, key
    assert rope_config(AutoConfig.from_pretrained(model_dirs["llama"])).get("rope_type") in (
        None,
        "default",
    )
    scaled = load_model(directory).model.rotary_emb.inv_freq
    plain = load_model(model_dirs["llama"]).model.rotary_emb.inv_freq
    assert scaled.shape == plain.shape
    assert not torch.allclose(scaled, plain), "the scaling changes no frequency of the tiny model"


def test_rope_theta_and_config_overrides(tmp_path: Path) -> None:
    directory = build_tiny_model(
        tmp_path / "m", "qwen3", rope_theta=500000.0, num_hidden_layers=1, vocab_size=300
    )
    config = AutoConfig.from_pretrained(directory)
    assert rope_config(config)["rope_theta"] == 500000.0
    assert config.num_hidden_layers == 1
    assert len(AutoTokenizer.from_pretrained(directory)) == config.vocab_size == 300


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"architecture": "gpt2"}, "unknown architecture"),
        ({"size": "huge"}, "unknown size"),
        ({"vocab_size": 100}, "vocab_size"),
    ],
)
def test_bad_arguments_raise(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path / "m", **kwargs)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loaded_tokenizer_matches_built_one(model_dirs: dict[str, Path], arch: str) -> None:
    """transformers may rebuild the pipeline around our vocabulary (Qwen2): ids must not change."""
    loaded = AutoTokenizer.from_pretrained(model_dirs[arch])
    built = build_tokenizer(TINY["vocab_size"])
    for text in TEXTS:
        ids = loaded(text)["input_ids"]
        assert ids == built(text)["input_ids"], text
        assert loaded.decode(ids) == unicodedata.normalize("NFC", text)
    all_ids = list(range(TINY["vocab_size"]))
    assert loaded.batch_decode([[i] for i in all_ids]) == built.batch_decode([[i] for i in all_ids])


def test_tokenizer_specials_and_no_bos_on_encode(model_dirs: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.bos_token == BOS_TOKEN
    assert tokenizer.eos_token_id != tokenizer.bos_token_id
    ids = tokenizer("Hello world")["input_ids"]
    assert tokenizer.bos_token_id not in ids and tokenizer.eos_token_id not in ids
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == (
        "Hello world"
    )


def test_tokenizer_training_is_deterministic() -> None:
    train = tiny_model._tokenizer_json.__wrapped__  # bypass the per-process cache
    assert train(TINY["vocab_size"]) == train(TINY["vocab_size"])


@pytest.mark.parametrize("vocab_size", [TINY["vocab_size"], SIZES["small"]["vocab_size"]])
def test_every_id_decodes(vocab_size: int) -> None:
    tokenizer = build_tokenizer(vocab_size)
    assert len(tokenizer) == vocab_size
    vocab = tokenizer.get_vocab()
    assert sorted(vocab.values()) == list(range(vocab_size))
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)])
    assert all(isinstance(text, str) for text in texts)
    # Past the special tokens every id decodes to some text.
    assert all(texts[2:]), [i for i, text in enumerate(texts) if not text]
    # A long random id sequence decodes without error too.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (500,), generator=generator).tolist()
    assert isinstance(tokenizer.decode(ids), str)


def test_small_preset_size() -> None:
    small = SIZES["small"]
    head_dim = small["hidden_size"] // small["num_attention_heads"]
    kv_dim = small["num_key_value_heads"] * head_dim
    per_layer = (
        2 * small["hidden_size"] ** 2
        + 2 * small["hidden_size"] * kv_dim
        + 3 * small["hidden_size"] * small["intermediate_size"]
    )
    embeddings = small["vocab_size"] * small["hidden_size"]
    num_params = small["num_hidden_layers"] * per_layer + embeddings
    assert 10_000_000 < num_params < 100_000_000, num_params


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_are_peaky(model_dirs: dict[str, Path], arch: str) -> None:
    """Greedy comparisons with the reference need clear winners, not near-ties."""
    model = load_model(model_dirs[arch])
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, TINY["vocab_size"], (8, 64), generator=generator)
    with torch.no_grad():
        logits = model(input_ids).logits  # [batch, seq, vocab]
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.median() > 0.05, gaps.median()
    assert (gaps < 1e-3).float().mean() < 0.02, (gaps < 1e-3).float().mean()


def test_cli_make_tiny_model_matches_library(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    output_dir = tmp_path / "cli"
    assert main(["make-tiny-model", str(output_dir), "--arch", "qwen3", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(output_dir)
    expected = build_tiny_model(tmp_path / "lib", "qwen3", seed=3)
    assert file_digests(output_dir) == file_digests(expected)


def test_cli_make_tiny_model_rope_scaling(tmp_path: Path) -> None:
    output_dir = tmp_path / "cli"
    args = ["make-tiny-model", str(output_dir), "--llama3-rope-scaling"]
    assert main([*args, "--max-position-embeddings", "2048"]) == 0
    config = AutoConfig.from_pretrained(output_dir)
    assert rope_config(config)["rope_type"] == "llama3"
    assert config.max_position_embeddings == 2048


def test_cli_usage(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 2
    assert "make-tiny-model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["make-tiny-model", "--help"])
    assert exit_info.value.code == 0
    assert "--arch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["make-tiny-model", "out", "--arch", "gpt2"])
    assert exit_info.value.code == 2


def test_cli_generate_matches_transformers_greedy(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    try:
        from rollout_engine import LLM  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"offline LLM not importable: {exc}")
    directory = model_dirs["llama"]
    prompt = "The people said"
    argv = ["generate", "--model", str(directory), "--prompt", prompt, "--max-tokens", "8"]
    assert main([*argv, "--show-token-ids"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"[prompt {prompt!r}, sample 0, ")
    token_ids = [int(t) for t in lines[1].split(":", 1)[1].strip(" []").split(",")]

    tokenizer = AutoTokenizer.from_pretrained(directory)
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    expected = load_model(directory).generate(input_ids, max_new_tokens=8, do_sample=False)
    assert token_ids == expected[0, input_ids.shape[1] :].tolist()
