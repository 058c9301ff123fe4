"""A compiled constraint: the byte-level automaton of its regex, determinized lazily, and the
token masks of the states requests visit; shared (read-only) by every request with the
same spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from spruce.constrained.bitmask import pack_token_ids
from spruce.constrained.byte_dfa import DEAD, ByteDFA
from spruce.constrained.byte_nfa import ByteNFA
from spruce.constrained.cursor import GrammarCursor
from spruce.constrained.vocab import TokenVocabulary

if TYPE_CHECKING:
    from spruce.constrained.spec import ConstraintSpec


class CompiledGrammar:
    """States are the lazy DFA's (byte_dfa.py). A state's token mask is computed on first use
    by walking the vocabulary's byte trie from it (token_trie.py: a few ms for a state
    allowing most of a 49k vocabulary, far less elsewhere) and cached; the caches only grow,
    with identical values, so concurrent readers are safe."""

    def __init__(self, spec: ConstraintSpec, nfa: ByteNFA, vocab: TokenVocabulary) -> None:
        self.spec = spec
        self.regex = spec.regex
        self.vocab = vocab
        self.dfa = ByteDFA(nfa)
        self.initial_state = self.dfa.initial
        self._states: dict[int, _StateInfo] = {}

    def cursor(self) -> GrammarCursor:
        return GrammarCursor(self)

    def next_state(self, state: int, token_id: int) -> int | None:
        """The state after `token_id` (never EOS), None when it is not allowed."""
        if not 0 <= token_id < self.vocab.vocab_size:
            return None
        data = self.vocab.token_bytes[token_id]
        if not data:  # EOS, special tokens, ids past the tokenizer's
            return None
        nxt = self.dfa.walk(state, data)
        return None if nxt == DEAD else nxt

    def is_final(self, state: int) -> bool:
        """Whether the output so far matches the constraint (EOS allowed)."""
        return self.dfa.is_accepting(state)

    def mask(self, state: int) -> torch.Tensor:
        """Packed int32 [num_words]: the tokens allowed in `state`, EOS only if accepting."""
        return self._state_info(state).mask

    def has_continuation(self, state: int) -> bool:
        """Whether some non-EOS token is allowed in `state`."""
        return self._state_info(state).has_continuation

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every output from `state` continues with (see ByteDFA.forced_bytes)."""
        return self.dfa.forced_bytes(state)

    def _state_info(self, state: int) -> _StateInfo:
        info = self._states.get(state)
        if info is None:
            allowed = np.flatnonzero(self.vocab.trie.allowed(self.dfa, state))
            has_continuation = allowed.size > 0
            if self.dfa.is_accepting(state):
                allowed = np.concatenate([allowed, sorted(self.vocab.eos_token_ids)])
            info = _StateInfo(pack_token_ids(allowed, self.vocab.vocab_size), has_continuation)
            self._states[state] = info
        return info


class _StateInfo(NamedTuple):
    mask: torch.Tensor
    has_continuation: bool
