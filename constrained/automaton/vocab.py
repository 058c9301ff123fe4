"""The tokenizer's vocabulary as the constrained decoder sees it, built once per compiler."""

from __future__ import annotations

from typing import Protocol

from spruce.constrained.automaton.token_trie import TokenTrie
from spruce.constrained.core.bitmask import num_words, pack_token_ids


class _TokenizerLike(Protocol):
    vocab_size: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]

    def token_bytes(self) -> list[bytes]: ...


class TokenVocabulary:
    """Raw bytes of every id below `vocab_size` (the model's logits width, which may exceed
    the tokenizer's: extra ids have no bytes), the EOS ids, and the byte trie the token
    masks are walked on. EOS and other special tokens get no bytes here: a grammar never
    allows them as text (EOS is allowed where the grammar accepts). Immutable."""

    def __init__(self, tokenizer: _TokenizerLike, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.num_words = num_words(self.vocab_size)
        self.eos_token_ids = frozenset(i for i in tokenizer.eos_token_ids if i < self.vocab_size)
        if not self.eos_token_ids:
            raise ValueError(
                "the tokenizer has no EOS token below vocab_size; constraints need one to end"
            )
        excluded = tokenizer.special_token_ids | self.eos_token_ids
        raw = tokenizer.token_bytes()
        # What a backend that matches special tokens itself needs (llguidance: `<|im_end|>`
        # in a grammar is that token): their text, and the tokenizer's encoder.
        self.special_bytes = {i: raw[i] for i in sorted(excluded) if i < len(raw)}
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.encode = getattr(tokenizer, "encode", None)
        self.token_bytes = [
            b"" if i >= len(raw) or i in excluded else raw[i] for i in range(self.vocab_size)
        ]
        self.trie = TokenTrie(self.token_bytes)
        self.eos_mask = pack_token_ids(sorted(self.eos_token_ids), self.vocab_size)
