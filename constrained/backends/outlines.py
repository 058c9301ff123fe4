"""The outlines backend (PyPI `outlines-core`, Rust): regexes, and JSON schemas through
outlines-core's own converter (`build_regex_from_schema`: what SGLang's classic backend
enforces, for users who migrate with `--grammar-backend outlines`). The whole token-level
index of the regex is built at compile time; a state's mask is packed once and cached.

    grammar = OutlinesGrammar(spec, vocab, max_bytes)    # builds the Index of spec.regex
    cursor = grammar.cursor()                           # cursor.GrammarCursor over its states

The grammar has the state interface of the spruce automaton (grammar.CompiledGrammar:
initial_state, next_state, is_final, mask, prepare_mask, may_continue, forced_bytes), so
the cursor is the spruce one.
"""

from __future__ import annotations

import json
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import outlines_core
import torch

from spruce.constrained.automaton.cursor import GrammarCursor
from spruce.constrained.core.bitmask import pack_token_ids
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.memory import Budgeted, SharedBudget

if TYPE_CHECKING:
    from spruce.constrained.automaton.vocab import TokenVocabulary
    from spruce.constrained.schema.schema_context import SchemaOptions
    from spruce.constrained.spec import ConstraintSpec

# outlines-core does not say how large an Index is: its transitions grow with the regex's
# DFA states times the tokens allowed in each (a rough per-regex-character charge), and each
# cached mask costs its packed row plus the tensor object.
INDEX_BYTES_PER_REGEX_CHAR = 4096
MASK_OVERHEAD_BYTES = 600
MAX_FORCED_BYTES = 256  # forced text is followed at most this far (a cycle of forced bytes)

_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()


def outlines_vocabulary(vocab: TokenVocabulary) -> outlines_core.Vocabulary:
    """outlines-core's view of the vocabulary (once per TokenVocabulary): every id with bytes;
    EOS, special tokens and ids past the tokenizer have none and are left out."""
    with _vocabularies_lock:
        vocabulary = _vocabularies.get(vocab)
        if vocabulary is None:
            tokens: dict[bytes, list[int]] = {}
            for token_id, data in enumerate(vocab.token_bytes):
                if data:
                    tokens.setdefault(data, []).append(token_id)
            vocabulary = _vocabularies[vocab] = outlines_core.Vocabulary(
                min(vocab.eos_token_ids), tokens
            )
        return vocabulary


def schema_regex(schema: Any, options: SchemaOptions) -> str | None:
    """outlines-core's regex for a JSON schema (None when it does not support the schema);
    whitespace between tokens as `options.whitespace_pattern` (none by default). Keywords
    outlines-core ignores (minimum, maxLength of some types, ...) are not reported."""
    try:
        return outlines_core.json_schema.build_regex_from_schema(
            json.dumps(schema), options.whitespace_pattern
        )
    except (ValueError, TypeError, RecursionError):
        return None


def compile_grammar(
    spec: ConstraintSpec, vocab: TokenVocabulary, max_bytes: int, shared: SharedBudget | None = None
) -> OutlinesGrammar:
    return OutlinesGrammar(spec, vocab, max_bytes, shared)


class OutlinesGrammar(Budgeted):
    """A compiled outlines-core Index, shared by the requests with the same spec. Thread-safe
    for reads; the mask cache only grows (charged to the grammar's byte budget)."""

    backend = "outlines"

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
        self.budget.charge(INDEX_BYTES_PER_REGEX_CHAR * len(spec.regex) + sys.getsizeof(spec.value))
        try:
            self._index = outlines_core.Index(spec.regex, outlines_vocabulary(vocab))
        except (ValueError, TypeError) as e:
            raise ConstraintError(
                f"the outlines grammar backend cannot compile this {spec.kind}: {e}"
            ) from None
        self.initial_state = self._index.get_initial_state()
        self._final = frozenset(self._index.get_final_states())
        self._masks: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    @property
    def work(self) -> int:
        """Masks made so far (each is one lookup in the prebuilt Index, then packed)."""
        return len(self._masks)

    def cursor(self) -> GrammarCursor:
        return GrammarCursor(self)

    def warm(self, state: int | None = None) -> None:
        self.mask(self.initial_state if state is None else state)

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after `token_id` (never EOS), None when it is not allowed."""
        if not 0 <= token_id < self.vocab.vocab_size or not self.vocab.token_bytes[token_id]:
            return None
        return self._index.get_next_state(state, token_id)

    def is_final(self, state: int) -> bool:
        return state in self._final

    def mask(self, state: int) -> torch.Tensor:
        """Packed int32 [num_words]: the tokens allowed in `state`, every EOS id if final."""
        mask = self._masks.get(state)
        if mask is None:
            allowed = [t for t in self._allowed(state) if t not in self.vocab.eos_token_ids]
            if self.is_final(state):
                allowed += sorted(self.vocab.eos_token_ids)
            mask = pack_token_ids(allowed, self.vocab.vocab_size)
            with self._lock:
                if state not in self._masks:
                    self.budget.charge(mask.numel() * 4 + MASK_OVERHEAD_BYTES)
                    self._masks[state] = mask
                mask = self._masks[state]
        return mask

    def prepare_mask(self, state: int, max_new_states: int) -> bool:
        """The Index is built whole at compile time: a mask is never more than a lookup."""
        self.mask(state)
        return True

    def may_continue(self, state: int) -> bool:
        return any(t not in self.vocab.eos_token_ids for t in self._allowed(state))

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every output from `state` continues with: the common prefix of the
        allowed tokens' bytes, followed on through a token that is exactly that prefix (the
        Index's states are those of a byte DFA, so where the prefix ends does not depend on
        the tokens that spelled it)."""
        forced, seen = b"", set()
        while state not in seen and not self.is_final(state) and len(forced) < MAX_FORCED_BYTES:
            seen.add(state)
            tokens = [t for t in self._allowed(state) if t not in self.vocab.eos_token_ids]
            prefix = _common_prefix([self.vocab.token_bytes[t] for t in tokens])
            forced += prefix
            whole = next((t for t in tokens if self.vocab.token_bytes[t] == prefix), None)
            if not prefix or whole is None:
                break
            state = self._index.get_next_state(state, whole)
        return forced[:MAX_FORCED_BYTES]

    def _allowed(self, state: int) -> list[int]:
        return self._index.get_allowed_tokens(state) or []


def _common_prefix(items: list[bytes]) -> bytes:
    if not items:
        return b""
    low, high = min(items), max(items)
    size = 0
    while size < min(len(low), len(high)) and low[size] == high[size]:
        size += 1
    return low[:size]
