"""Tests for course_lib.model.tokenizer: the course vocabulary, its text form and its Hugging Face tokenizer."""

import pytest
import torch

from course_lib.data import MarkovLanguage
from course_lib.model.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    VOCAB,
    VOCAB_SIZE,
    decode,
    encode,
    save_hf_tokenizer,
)

# ------------------------------------------------------------------------------------------
# vocabulary
# ------------------------------------------------------------------------------------------


def test_vocabulary_layout():
    assert VOCAB_SIZE == 64 and VOCAB_SIZE % 8 == 0, "VOCAB_SIZE is 64, a multiple of 8 (lec. 01)"
    assert len(VOCAB) == VOCAB_SIZE and len(set(VOCAB)) == VOCAB_SIZE, "one distinct string per id"
    assert (BOS_ID, EOS_ID, PAD_ID, UNK_ID) == (60, 61, 62, 63), "special tokens sit after the 60 symbol slots"
    assert all(" " not in t for t in VOCAB), "no spaces inside tokens"


def test_encode_decode_round_trip():
    ids = list(range(VOCAB_SIZE))
    assert encode(decode(ids)) == ids, "encode must invert decode on every id"
    assert decode(torch.tensor([0, 6, EOS_ID])) == "ba de <eos>", "symbol s prints as VOCAB[s]"
    assert encode("  ba\nde   <eos> ") == [0, 6, EOS_ID], "any whitespace separates tokens"


def test_encode_decode_errors_name_the_constraint():
    with pytest.raises(ValueError, match="'xo' is not a token"):
        encode("ba xo")
    with pytest.raises(ValueError, match="0..63"):
        decode([0, 64])
    with pytest.raises(ValueError, match="one sequence"):
        decode(torch.zeros(2, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------
# Hugging Face tokenizer
# ------------------------------------------------------------------------------------------


def test_hf_tokenizer_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    save_hf_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(tok) == VOCAB_SIZE, "the HF tokenizer must have exactly the course vocabulary"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
        UNK_ID,
    ), "special token ids must match course_lib's"
    sample = MarkovLanguage().sample(200, seed=0).tolist() + [EOS_ID, BOS_ID, 3]
    text = decode(sample)
    assert tok.encode(text) == encode(text) == sample, (
        "AutoTokenizer must give course_lib's ids, with no <bos> added: vLLM and transformers "
        "generation are compared token by token against course_lib"
    )
    assert tok.decode(sample) == text, "HF decode must print the same text as course_lib.decode"
    assert tok.encode("ba xo") == [0, UNK_ID], "HF maps unknown words to <unk> (course_lib raises)"


def test_hf_tokenizer_padded_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    save_hf_tokenizer(tmp_path / "tok", vocab_size=72)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert len(tok) == 72 and tok.convert_ids_to_tokens(71) == "<reserved_71>", (
        "ids past VOCAB_SIZE in a padded embedding become reserved special tokens"
    )
    assert tok.encode("ba de") == [0, 6]
    with pytest.raises(ValueError, match="vocab_size must be an int >= VOCAB_SIZE = 64"):
        save_hf_tokenizer(tmp_path / "bad", vocab_size=32)
