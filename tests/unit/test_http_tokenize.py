"""`/detokenize`'s decoding: without holding the GIL (the event loop goes on meanwhile), to the
same text as the tokenizer's own `decode`, transformers' clean-up of spaces included."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rollout_engine.server.http.tokenize import decode_releasing_gil
from rollout_engine.tiny_model import build_tokenizer


def word_piece_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, ",": 3, ".": 4, "'s": 5, "##c": 6, "?": 7}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.mark.parametrize("clean_up", [False, True])
def test_detokenize_decodes_as_the_tokenizer_does(clean_up):
    rng = random.Random(1)
    for tokenizer in (build_tokenizer(512), word_piece_tokenizer()):  # BPE, and WordPiece
        tokenizer.clean_up_tokenization_spaces = clean_up
        vocab_size = len(tokenizer.get_vocab())
        for _ in range(50):
            ids = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 30))]
            assert decode_releasing_gil(tokenizer, ids) == tokenizer.decode(ids), ids
