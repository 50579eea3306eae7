"""A SentencePiece-style tokenizer (Metaspace pre-tokenizer and decoder, byte fallback), as
Llama-2, Mistral and Gemma ship, and a tiny model directory that uses it.

Its decoder drops the leading space of a sequence's first token: the same tokens read
`"the the"` alone and `" the the"` after a prompt, which is what completion texts must get
right (vLLM decodes them after the prompt's last tokens)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from rollout_engine.tiny_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    build_tiny_model,
    make_corpus,
)

VOCAB_SIZE = 512
"""The tiny model's: special tokens, trained pieces, then the 256 byte tokens."""


def build_metaspace_tokenizer(vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=BOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def build_metaspace_model(output_dir: str | Path, llama_dir: Path | None = None) -> Path:
    """The tiny llama of `build_tiny_model` with this tokenizer in place of its own: a copy of
    `llama_dir` (that model, built already) if given, else built here."""
    if llama_dir is None:
        model_dir = build_tiny_model(output_dir, "llama", "tiny", seed=0)
    else:
        model_dir = Path(shutil.copytree(llama_dir, Path(output_dir) / "model"))
        for path in model_dir.glob("*token*"):  # the llama's own tokenizer files
            path.unlink()
    build_metaspace_tokenizer().save_pretrained(model_dir)
    return model_dir


@functools.lru_cache(maxsize=2)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=list(SPECIAL_TOKENS),
                                  show_progress=False)
    tokenizer.train_from_iterator(make_corpus(), trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    assert len(vocab) == vocab_size, len(vocab)
    return json.dumps(spec, ensure_ascii=False)
