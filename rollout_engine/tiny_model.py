"""Writes small Hugging Face model directories with random weights, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")

SIZES: dict[str, dict[str, int]] = {
    # About 140k parameters: builds in about 0.1 s and runs a forward in milliseconds.
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
    },
    # About 30M parameters: big enough for throughput numbers to mean something on a CPU.
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
        "vocab_size": 8192,
    },
    # Qwen2-0.5B's shape (about 0.5B parameters): the GPU benchmarks' model.
    "0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
    },
}

# Llama-3.1's RoPE scaling, with the original context shrunk to fit the presets' 1024 positions.
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, BOS_TOKEN)
# Special tokens plus the 256 byte-level symbols: the smallest vocabulary that encodes any text.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
# Pre-tokenization split (Qwen2's): contractions, words, single digits, punctuation, spaces.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Standard deviation of the extra noise on norm weights (around 1) so that an engine
# ignoring a norm's weight produces different tokens than the reference.
NORM_WEIGHT_NOISE = 0.1

# Common English words: the tokenizer's training text is made of these.
_WORDS_TEXT = """
the of and to a in is it you that he was for on are with as his they be at one have this
from or had by hot word but what some we can out other were all there when up use your how
said an each she which do their time if will way about many then them write would like so
these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work
part take get place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help low line
differ turn cause much mean before move right boy old too same tell does set three want air
well also play small end put home read hand port large spell add even land here must big
high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye
never last let thought city tree cross farm hard start might story saw far sea draw left
late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile
river car feet care second book carry took science eat room friend began idea fish mountain
stop once base hear horse cut sure watch color face wood main enough plain girl usual young
ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice
voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star
box noun field rest correct able pound done beauty drive stood contain front teach week final
gave green oh quick develop ocean warm free minute strong special mind behind clear tail
produce fact street inch multiply nothing course stay wheel full force blue object decide
surface deep moon island foot system busy test record boat common gold possible plane stead
dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring
yes distant fill east paint language among
"""


def build_tiny_model(
    output_dir: str | Path,
    architecture: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    *,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    initializer_range: float = 0.1,
    max_position_embeddings: int = 1024,
    **config_overrides: Any,
) -> Path:
    """Write a randomly initialised `*ForCausalLM` checkpoint plus its tokenizer to `output_dir`.

    The same arguments always give byte-identical files. `initializer_range` is larger than
    the usual 0.02 so the top logits are well separated and greedy decoding has no near-ties.
    `rope_scaling` takes a Llama-3 style dict (`{"rope_type": "llama3", "factor": ...}`).
    `config_overrides` are passed to the config class last (e.g. `num_hidden_layers=1`).
    """
    config = make_config(
        architecture,
        size,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        initializer_range=initializer_range,
        max_position_embeddings=max_position_embeddings,
        **config_overrides,
    )
    return write_model_dir(output_dir, config, seed)


def write_model_dir(output_dir: str | Path, config: PretrainedConfig, seed: int = 0) -> Path:
    """Write the `*ForCausalLM` of any transformers `config` with seeded random weights (see
    `_build_model`), plus a tokenizer of its `vocab_size`, to `output_dir`."""
    import torch
    from transformers import GenerationConfig

    output_dir = Path(output_dir)
    tokenizer = build_tokenizer(config.vocab_size)
    model = _build_model(config, seed)
    assert model.dtype == torch.float32, model.dtype
    output_dir.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    generation_config = GenerationConfig(
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    generation_config.save_pretrained(output_dir)
    return output_dir


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' per-shard progress bar, restoring the previous setting."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def make_config(
    architecture: str = "llama",
    size: str = "tiny",
    *,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    initializer_range: float = 0.1,
    max_position_embeddings: int = 1024,
    **config_overrides: Any,
) -> PretrainedConfig:
    """The transformers config `build_tiny_model` uses, without building any weights."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {ARCHITECTURES}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    if tie_word_embeddings is None:
        tie_word_embeddings = architecture != "llama"  # as in the released checkpoints
    kwargs: dict[str, Any] = dict(SIZES[size])
    kwargs.update(
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
    )
    kwargs.update(_architecture_kwargs(architecture, kwargs))
    kwargs.update(config_overrides)
    if kwargs["vocab_size"] < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {kwargs['vocab_size']}")
    kwargs.update(_rope_kwargs(rope_scaling, kwargs.pop("rope_theta", 10000.0)))
    config = _config_class(architecture)(**kwargs)
    config.dtype = "float32"
    return config


def _architecture_kwargs(architecture: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Settings that differ between the supported families."""
    if architecture == "llama":
        return {"attention_bias": False, "mlp_bias": False}
    if architecture == "qwen2":
        # Qwen2 always has q/k/v biases; no sliding window, so every layer is full attention.
        return {"use_sliding_window": False}
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return {"head_dim": head_dim, "attention_bias": False, "use_sliding_window": False}


def _rope_kwargs(rope_scaling: dict[str, Any] | None, rope_theta: float) -> dict[str, Any]:
    """RoPE settings in the form the installed transformers expects.

    transformers 5 keeps everything in `rope_parameters` (theta included); 4.x used
    `rope_theta` plus an optional `rope_scaling` dict.
    """
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta}
        return {"rope_parameters": parameters}
    return {"rope_theta": rope_theta, "rope_scaling": dict(rope_scaling) if rope_scaling else None}


def _config_class(architecture: str) -> type[PretrainedConfig]:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[architecture]


def _build_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """Construct the model and give every parameter seeded random values."""
    import torch
    from transformers import AutoModelForCausalLM

    # transformers initialises from the global stream: seed it, and hand the caller's back.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Our own draw over every parameter keeps the weights independent of the
    # transformers version's init scheme.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _init_parameter(name, param, config.initializer_range, generator)
    model.eval()
    return model


def _init_parameter(name: str, param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Matrices and biases ~ N(0, std); norm weights ~ 1 + N(0, NORM_WEIGHT_NOISE).

    Non-zero biases and non-unit norm weights make a reimplementation that forgets
    either one disagree with the reference.
    """
    import torch

    noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
    if param.ndim == 1 and name.endswith("norm.weight"):
        param.copy_(1.0 + NORM_WEIGHT_NOISE * noise)
    else:
        param.copy_(std * noise)


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, every one of them decodable.

    Ids 0 and 1 are `<|endoftext|>` (EOS and padding) and `<|bos|>`. No BOS is added
    on encode, so the ids a prompt encodes to are the same for every consumer.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    backend = Tokenizer.from_str(_tokenizer_json(vocab_size))
    assert backend.get_vocab_size() == vocab_size, backend.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


@functools.lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> str:
    """Train byte-level BPE on a fixed corpus, pad its vocabulary to `vocab_size`, serialise."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The pipeline of Qwen2's tokenizer class, which transformers rebuilds around the
    # vocabulary for `qwen2` checkpoints: every loader then tokenizes the same way.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_corpus(), trainer)
    spec = json.loads(tokenizer.to_str())
    _pad_vocab(spec["model"]["vocab"], vocab_size)
    return json.dumps(spec, ensure_ascii=False)


def _pad_vocab(vocab: dict[str, int], vocab_size: int) -> None:
    """Fill ids up to `vocab_size` with letter strings that no merge produces.

    They are never emitted by encoding, but a model may sample them and they decode to
    plain letters, like the rarely used entries of a real vocabulary.
    """
    letters = "abcdefghijklmnopqrstuvwxyz"
    prefixes = ("", "\u0120")  # "Ġ": the byte-level symbol of a space
    short = (p + a + b + c for p in prefixes for a in letters for b in letters
             for c in ("",) + tuple(letters))
    # Four letters only once three are used up (real-sized vocabularies, ~150k entries).
    long = (p + a + b + c + d for p in prefixes for a in letters for b in letters
            for c in letters for d in letters)
    candidates = itertools.chain(short, long)
    next_id = len(vocab)
    assert sorted(vocab.values()) == list(range(next_id)), "trained ids are not contiguous"
    for candidate in candidates:
        if next_id >= vocab_size:
            return
        if candidate not in vocab:
            vocab[candidate] = next_id
            next_id += 1
    raise ValueError(f"vocab_size {vocab_size} is too large for the padding scheme")


def make_corpus(num_sentences: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic English-like sentences from a fixed word list."""
    rng = random.Random(seed)
    words_list = _WORDS_TEXT.split()
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(words_list) for _ in range(rng.randint(4, 14))]
        sentence = " ".join([words[0].capitalize(), *words[1:]])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        sentences.append(sentence + rng.choice(".....?!,;"))
    return sentences
