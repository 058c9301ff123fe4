"""A compiled constraint: the outlines-core token index plus the character automaton,
shared (read-only) by every request with the same spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import outlines_core
import torch

from spruce.constrained.bitmask import pack_token_ids
from spruce.constrained.cursor import GrammarCursor
from spruce.constrained.jump_forward import CharAutomaton
from spruce.constrained.vocab import TokenVocabulary

if TYPE_CHECKING:
    from spruce.constrained.spec import ConstraintSpec


class CompiledGrammar:
    """Immutable once built. The index is built for `patterns.index_regex(regex)`: a state
    accepts when the virtual end-mark token is allowed there. A state's packed mask is
    computed on first use (~1 ms for a state allowing most of a 49k vocabulary) and cached;
    that cache only grows, with identical values, so concurrent readers are safe."""

    def __init__(
        self,
        spec: ConstraintSpec,
        regex: str,
        index: outlines_core.Index,
        vocab: TokenVocabulary,
        char_automaton: CharAutomaton | None,
    ) -> None:
        self.spec = spec
        self.regex = regex
        self.index = index
        self.vocab = vocab
        self.char_automaton = char_automaton  # None: jump-forward unavailable
        self.initial_state = index.get_initial_state()
        self._states: dict[int, _StateInfo] = {}

    def cursor(self) -> GrammarCursor:
        return GrammarCursor(self)

    def next_state(self, state: int, token_id: int) -> int | None:
        """The index state after `token_id` (never EOS), None when it is not allowed."""
        if not 0 <= token_id < self.vocab.vocab_size or token_id in self.vocab.eos_token_ids:
            return None
        return self.index.get_next_state(state, token_id)

    def is_final(self, state: int) -> bool:
        """Whether the output so far matches the constraint (EOS allowed)."""
        return self._state_info(state).accepting

    def mask(self, state: int) -> torch.Tensor:
        """Packed int32 [num_words]: the tokens allowed in `state`, EOS only if accepting."""
        return self._state_info(state).mask

    def has_continuation(self, state: int) -> bool:
        """Whether some non-EOS token is allowed in `state`."""
        return self._state_info(state).has_continuation

    def _state_info(self, state: int) -> _StateInfo:
        info = self._states.get(state)
        if info is None:
            vocab = self.vocab
            allowed = np.asarray(self.index.get_allowed_tokens(state), dtype=np.int64)
            accepting = bool((allowed == vocab.end_mark_id).any())
            allowed = allowed[allowed < vocab.vocab_size]  # drops the end mark
            allowed = allowed[allowed != vocab.outlines_eos]
            has_continuation = allowed.size > 0
            if accepting:
                allowed = np.concatenate([allowed, sorted(vocab.eos_token_ids)])
            mask = pack_token_ids(allowed, vocab.vocab_size)
            info = _StateInfo(mask, accepting, has_continuation)
            self._states[state] = info
        return info


class _StateInfo(NamedTuple):
    mask: torch.Tensor
    accepting: bool
    has_continuation: bool
