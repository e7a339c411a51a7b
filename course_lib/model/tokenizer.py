"""The course vocabulary: 64 tokens, their text form, and the same vocabulary as a Hugging Face tokenizer.

    ids  0..59  symbol slots, printed as syllables "ba", "be", ..., "tu" (12 consonants x 5 vowels);
                a language with n_symbols = m (course_lib.data.MarkovLanguage) emits symbol s as id s
    id  60      <bos>   id 61  <eos>   id 62  <pad>   id 63  <unk>

``VOCAB_SIZE = 64`` is a multiple of 8 because embedding and output-layer shapes that are multiples
of 8 map onto tensor-core tiles (lecture 01). ``encode``/``decode`` turn whitespace-separated
syllables into ids and back, so samples can be shown to a learner as text; ``save_hf_tokenizer``
writes the same vocabulary as Hugging Face tokenizer files, made offline, so an exported course
model (``course_lib.model.hf_export.export_hf``) loads in transformers and vLLM with its tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

VOCAB_SIZE = 64
SYMBOLS: tuple[str, ...] = tuple(c + v for c in "bdfgklmnprst" for v in "aeiou")
N_SYMBOL_SLOTS = len(SYMBOLS)  # 60
SPECIAL_TOKENS: tuple[str, ...] = ("<bos>", "<eos>", "<pad>", "<unk>")
BOS_ID, EOS_ID, PAD_ID, UNK_ID = range(N_SYMBOL_SLOTS, N_SYMBOL_SLOTS + len(SPECIAL_TOKENS))
VOCAB: tuple[str, ...] = SYMBOLS + SPECIAL_TOKENS  # VOCAB[token_id] is the token's text
assert len(VOCAB) == VOCAB_SIZE and VOCAB_SIZE % 8 == 0
_ID_OF = {token: i for i, token in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Whitespace-separated tokens -> token ids: ``encode("ba de <eos>") == [0, 6, 61]``.

    Unknown words are an error here (Hugging Face's tokenizer maps them to <unk> instead): a typo in
    a lecture's prompt should stop the cell, not become a silent <unk>.
    """
    ids = []
    for word in text.split():
        if word not in _ID_OF:
            raise ValueError(
                f"{word!r} is not a token of the course language. Tokens are the syllables "
                f"{SYMBOLS[0]!r}..{SYMBOLS[-1]!r} (consonant from 'bdfgklmnprst' + vowel) and "
                f"{', '.join(SPECIAL_TOKENS)}, separated by whitespace."
            )
        ids.append(_ID_OF[word])
    return ids


def decode(ids: Sequence[int] | torch.Tensor) -> str:
    """Token ids -> text, tokens joined by one space: ``decode([0, 6, 61]) == "ba de <eos>"``."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() > 1:
            raise ValueError(
                f"decode takes one sequence (a 1-D tensor), got shape {tuple(ids.shape)}; "
                "for a batch use [decode(row) for row in batch]."
            )
        ids = ids.tolist()
    bad = [i for i in ids if not 0 <= int(i) < VOCAB_SIZE]
    if bad:
        raise ValueError(f"token ids must lie in 0..{VOCAB_SIZE - 1} (VOCAB_SIZE = {VOCAB_SIZE}), got {bad[:5]}")
    return " ".join(VOCAB[int(i)] for i in ids)


def save_hf_tokenizer(path: str | Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Write a Hugging Face tokenizer for the course vocabulary to the folder ``path``.

    tokenizer.json is built offline with the ``tokenizers`` library: a WordLevel model (one id per
    whole word, ids = course_lib ids) after a WhitespaceSplit pre-tokenizer (split on whitespace
    only, as ``encode`` does), the four special tokens registered as special so that
    ``decode(..., skip_special_tokens=True)`` drops them, and no post-processor, so no <bos> is
    added behind the caller's back. transformers' ``save_pretrained`` writes the matching
    tokenizer_config.json, so ``AutoTokenizer.from_pretrained(path)`` loads it with no network and
    encodes/decodes the same ids as ``encode``/``decode``.

    ``vocab_size`` is the model's embedding size. If it exceeds VOCAB_SIZE (an embedding padded for
    tensor parallelism, say), ids VOCAB_SIZE..vocab_size-1 become special tokens "<reserved_i>",
    so every id the model can emit decodes to something.
    """
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast  # imported here: it takes seconds to load

    if not isinstance(vocab_size, int) or vocab_size < VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int >= VOCAB_SIZE = {VOCAB_SIZE} (the course vocabulary needs "
            f"ids 0..{VOCAB_SIZE - 1}); got {vocab_size!r}. Build the model with "
            "vocab_size=course_lib.model.tokenizer.VOCAB_SIZE."
        )
    reserved = tuple(f"<reserved_{i}>" for i in range(VOCAB_SIZE, vocab_size))
    tokens = VOCAB + reserved
    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS + reserved])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # its rules are for English punctuation, not ours
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(path))
