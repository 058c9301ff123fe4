"""The llguidance backend (PyPI `llguidance`, Rust): context-free grammars (its Lark dialect;
GBNF through its converter), JSON schemas with recursion, regexes, lazy lexemes and special
tokens. An Earley parser over a lazily built lexer DFA: a mask is computed per step (tens of
microseconds, bounded by the parser's fuel limits below), nothing per state is cached here.

    grammar = LLGuidanceGrammar(spec, vocab)     # compiles spec.grammar (llguidance's form)
    cursor = grammar.cursor()                    # a copy of the compiled matcher per request
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from spruce.constrained.automaton.cursor import CursorBase
from spruce.constrained.backends.llguidance_build import (
    TokenTable,
    first_mask,
    matcher_error,
    new_matcher,
    token_table,
    tokenizer_of,
)
from spruce.constrained.backends.llguidance_text import (
    lark_grammar,
    special_literals_as_tokens,
    unenforced_of,
)
from spruce.constrained.backends.structural_tag import structural_tag_to_lark
from spruce.constrained.core.bitmask import write_row
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.memory import Budgeted, SharedBudget

if TYPE_CHECKING:
    from spruce.constrained.automaton.vocab import TokenVocabulary
    from spruce.constrained.spec import ConstraintSpec

MATCHER_BYTES = 256 * 1024  # what a compiled matcher holds beyond its grammar text (roughly)
BYTES_PER_GRAMMAR_CHAR = 64  # the compiled grammar against its text (roughly, measured on schemas)

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def llg_tokenizer(vocab: TokenVocabulary) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary (built once per TokenVocabulary, ~0.1 s): every
    id's bytes, special tokens marked as such (a grammar names them as `<|im_end|>`)."""
    tokenizer = _tokenizers.get(vocab)
    if tokenizer is None:
        tokenizer = _tokenizers[vocab] = tokenizer_of(vocab_table(vocab), vocab.encode)
    return tokenizer


def vocab_table(vocab: TokenVocabulary) -> TokenTable:
    """The vocabulary as plain data (once per TokenVocabulary): what a build worker gets."""
    table = _tables.get(vocab)
    if table is None:
        table = _tables[vocab] = token_table(vocab)
    return table


def compile_grammar(
    spec: ConstraintSpec, vocab: TokenVocabulary, max_bytes: int, shared: SharedBudget | None = None
) -> LLGuidanceGrammar:
    return LLGuidanceGrammar(prepared(spec, vocab), vocab, max_bytes, shared)


def prepared(spec: ConstraintSpec, vocab: TokenVocabulary) -> ConstraintSpec:
    """The spec whose grammar is the one compiled for this vocabulary. A structural tag is
    converted again here, where the vocabulary is known: a trigger that is one of its
    special tokens matches that token (the front door checked the tag). A Lark grammar's
    quoted special-token texts become references to those tokens."""
    if spec.kind == "structural_tag":
        lark = structural_tag_to_lark(spec.value, special_tokens(vocab))
        return replace(spec, grammar=lark_grammar(lark, "structural_tag"))
    if spec.kind == "lark":
        lark = special_literals_as_tokens(spec.value, special_tokens(vocab))
        if lark != spec.value:
            return replace(spec, grammar=lark_grammar(lark))
    return spec


def special_tokens(vocab: TokenVocabulary) -> dict[str, int]:
    """The vocabulary's special tokens, text -> id."""
    return {
        data.decode("utf-8", "replace"): token_id for token_id, data in vocab.special_bytes.items()
    }


class LLGuidanceGrammar(Budgeted):
    """A compiled llguidance grammar, shared by the requests with the same spec: the matcher
    made once here is copied per request (its compiled grammar and lexer are shared)."""

    backend = "llguidance"
    work = 0  # masks are computed per step within llguidance's fuel (no states to count)

    def __init__(
        self,
        spec: ConstraintSpec,
        vocab: TokenVocabulary,
        max_bytes: int,
        shared: SharedBudget | None = None,
    ) -> None:
        self.spec = spec
        self.vocab = vocab
        super().__init__(max_bytes, shared)
        self.budget.charge(
            MATCHER_BYTES + BYTES_PER_GRAMMAR_CHAR * len(spec.grammar) + sys.getsizeof(spec.value)
        )
        matcher = new_matcher(llg_tokenizer(vocab), spec.grammar, spec.kind)
        if spec.fallback is not None:  # checked by this build: decided now
            self.spec = replace(
                spec,
                unenforced=unenforced_of(matcher.get_grammar_warnings(), spec.unenforced),
                fallback=None,
            )
        self._matcher = matcher
        self.initial_row: np.ndarray | None = None  # the first position's mask, once warm

    def cursor(self) -> LLGuidanceCursor:
        return LLGuidanceCursor(self, self._matcher.deep_copy())

    def warm(self) -> None:
        """Computes the first mask once (it also builds the lexer's first states, which
        copies share) and keeps it: a new cursor starts with it instead of computing it."""
        if self.initial_row is None:  # on the compiled matcher itself: a mask takes no token
            row = first_mask(self._matcher, self.vocab.num_words)
            self.budget.charge(row.nbytes)
            self.initial_row = row


class LLGuidanceCursor(CursorBase):
    """One request's llguidance matcher. The mask of the current position is computed once
    (`prepare_mask`, before the step) into a row of our own and copied by `fill_bitmask`;
    a sampled token is checked against that row before the matcher takes it (a token the
    matcher refused would leave it in its error state for good)."""

    __slots__ = (
        "grammar",
        "_matcher",
        "_tokens",
        "_row",
        "_row_view",
        "_row_ptr",
        "_ready",
        "_finished",
    )

    def __init__(self, grammar: LLGuidanceGrammar, matcher: llguidance.LLMatcher) -> None:
        self.grammar = grammar
        self._matcher = matcher
        self._tokens: list[int] = []
        self._row = np.zeros(grammar.vocab.num_words, dtype=np.int32)  # the current mask, once made
        self._row_view = torch.from_numpy(self._row)
        self._row_ptr = self._row.ctypes.data  # asked once: the property costs a microsecond
        self._ready = False
        self._finished = False

    @property
    def row(self) -> np.ndarray:
        """The current mask (packed int32), valid once `prepare_mask` ran."""
        return self._row

    def accept_token(self, token_id: int) -> bool:
        """EOS (where the grammar can end) finishes the cursor without reaching the matcher:
        llguidance's rollback over an EOS taken in a stopped state undoes a token too many.
        An EOS token the grammar itself names (`<|im_end|>` in a Lark rule) is the grammar's."""
        if self._finished or not 0 <= token_id < self.grammar.vocab.vocab_size:
            return False
        if token_id in self.grammar.vocab.eos_token_ids and self._matcher.is_accepting():
            self._finished = True
        elif not self._allows(token_id) or not self._matcher.consume_token(token_id):
            return False
        self._tokens.append(token_id)
        self._ready = False
        return True

    def prepare_mask(self, max_new_states: int = 0) -> bool:
        """Computes the current position's mask (bounded by llguidance's fuel, not by
        `max_new_states`); ConstraintError when the matcher failed (a limit, a dead end)."""
        if not self._ready:
            if self._finished:
                self._row[:] = self.grammar.vocab.eos_mask.numpy()
            elif not self._tokens and self.grammar.initial_row is not None:
                self._row[:] = self.grammar.initial_row  # made once for every request (warm)
            else:
                self._matcher.unsafe_compute_mask_ptr(self._row_ptr, self._row.nbytes)
                if self._matcher.is_error():
                    raise ConstraintError(f"the grammar failed: {matcher_error(self._matcher)}")
            self._ready = True
        return True

    def failure(self) -> str | None:
        """Why the matcher stopped taking tokens (its error state: a lexer or parser limit
        passed on a token the mask allowed), as a plain sentence."""
        return matcher_error(self._matcher) if self._matcher.is_error() else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.prepare_mask()
        write_row(bitmask, row, self._row_view)

    def can_end(self) -> bool:
        return self._finished or self._matcher.is_accepting()

    def is_terminated(self) -> bool:
        return self._finished or self._matcher.is_stopped()

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot roll back {n} tokens; {len(self._tokens)} accepted")
        if n:
            in_matcher = n - 1 if self._finished else n  # EOS never reached the matcher
            if in_matcher:
                self._matcher.rollback(in_matcher)
            del self._tokens[-n:]
            self._finished = False
            self._ready = False

    def copy(self) -> LLGuidanceCursor:
        clone = LLGuidanceCursor(self.grammar, self._matcher.deep_copy())
        clone._tokens = list(self._tokens)
        clone._row[:] = self._row
        clone._ready = self._ready
        clone._finished = self._finished
        return clone

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    def forced_bytes(self) -> bytes:
        """The forced bytes up to the first special token (llguidance marks one with a 0xFF
        byte: it is sampled as a token, never re-tokenized from text)."""
        return b"" if self._finished else self._matcher.compute_ff_bytes().split(b"\xff", 1)[0]

    def accepts(self, rollback: int, token_ids: list[int]) -> bool:
        """Whether `token_ids` may follow once the last `rollback` tokens are undone (EOS
        not among them: jump-forward never follows a finished cursor)."""
        probe = self._matcher.deep_copy()
        if rollback:
            probe.rollback(rollback)
        return probe.validate_tokens(list(token_ids)) == len(token_ids)

    def _allows(self, token_id: int) -> bool:
        if self._ready:
            return bool((int(self._row[token_id >> 5]) >> (token_id & 31)) & 1)
        return self._matcher.validate_tokens([token_id]) == 1
