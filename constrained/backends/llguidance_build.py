"""What an llguidance build needs outside the model's process: the vocabulary as plain data
(`TokenTable`, sent once to each build worker), the build's check (`check_build`: the
compiled matcher and its first mask, run in a worker under the deadline and memory cap,
build_worker.py), and llguidance's error text as a plain sentence (`plain_error`). No torch
here: the build workers import this module.

    table = token_table(vocab)                        # plain data, picklable
    check_build(grammar_text, tokenizer_of(table))    # ConstraintError with a plain message
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from spruce.constrained.backends.llguidance_errors import plain_error
from spruce.constrained.backends.llguidance_text import limits
from spruce.constrained.core.errors import ConstraintError, GrammarRefused

if TYPE_CHECKING:
    from spruce.constrained.automaton.vocab import TokenVocabulary


@dataclass(frozen=True, slots=True)
class TokenTable:
    """llguidance's view of a vocabulary: every id's bytes (a special token's as its text),
    which ids are special, EOS and BOS. `key` names the table: a worker that has it is sent
    the key alone."""

    tokens: tuple[bytes, ...]
    special_ids: tuple[int, ...]
    eos_ids: tuple[int, ...]
    bos_id: int | None
    vocab_size: int
    key: str = field(default_factory=lambda: uuid.uuid4().hex)


def token_table(vocab: TokenVocabulary) -> TokenTable:
    tokens = list(vocab.token_bytes)
    for token_id, data in vocab.special_bytes.items():
        tokens[token_id] = data
    return TokenTable(
        tuple(tokens),
        tuple(sorted(vocab.special_bytes)),
        tuple(sorted(vocab.eos_token_ids)),
        vocab.bos_token_id,
        vocab.vocab_size,
    )


def tokenizer_of(
    table: TokenTable, encode: Callable[..., list[int]] | None = None
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of the table (~0.1 s for a 50k vocabulary). `encode` (text ->
    ids) tokenizes the texts a grammar forces; without one (a build worker has no model
    tokenizer), llguidance's greedy tokenization over the table stands in: masks and limits
    are the same, only forced texts may split differently."""
    if encode is None:
        greedy = _tokenizer(table, _no_encoder)
        return _tokenizer(table, lambda text, **_: greedy.greedy_tokenize(_text(text)))
    return _tokenizer(table, encode)


def _tokenizer(table: TokenTable, encode: Callable[..., list[int]]) -> llguidance.LLTokenizer:
    wrapper = llguidance.TokenizerWrapper(_Tokens(table, encode))
    return llguidance.LLTokenizer(wrapper, n_vocab=table.vocab_size, eos_token=list(table.eos_ids))


class _Tokens:
    """The tokenizer interface llguidance.TokenizerWrapper reads."""

    def __init__(self, table: TokenTable, encode: Callable[..., list[int]]) -> None:
        self.tokens = list(table.tokens)
        self.special_token_ids = list(table.special_ids)
        self.eos_token_id = min(table.eos_ids)
        self.bos_token_id = table.bos_id
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


def _no_encoder(text: str, **_: object) -> list[int]:
    raise ValueError("no encoder")


def _text(text: str | bytes) -> str:
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else text


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str, what: str) -> llguidance.LLMatcher:
    """The compiled matcher of llguidance's grammar text; GrammarRefused naming `what` (the
    constraint's kind) when llguidance refuses it (auto may give it to the next backend)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise GrammarRefused(f"cannot compile the {what} constraint: {matcher_error(matcher)}")
    return matcher


def first_mask(matcher: llguidance.LLMatcher, num_words: int) -> np.ndarray:
    """The mask of the matcher's current position (packed int32); ConstraintError when the
    grammar fails there (it matches no string, a limit)."""
    row = np.zeros(num_words, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    if matcher.is_error():
        raise ConstraintError(f"the grammar failed: {matcher_error(matcher)}")
    return row


def check_build(grammar: str, tokenizer: llguidance.LLTokenizer, what: str = "grammar") -> None:
    """What a build does that can take long or grow large: compiling the grammar for the
    vocabulary and its first mask (the lexer's first states). Run in a build worker."""
    matcher = new_matcher(tokenizer, grammar, what)
    first_mask(matcher, (tokenizer.vocab_size + 31) // 32)


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    return plain_error(matcher.get_error())
