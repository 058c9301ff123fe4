"""A compiled constraint: the byte-level automaton of its regex, determinized lazily, and the
token masks of the states requests visit; shared (read-only) by every request with the
same spec."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NamedTuple

import torch

from spruce.constrained.automaton.byte_dfa import DEAD, MAX_BYTES, ByteDFA
from spruce.constrained.automaton.byte_nfa import ByteNFA
from spruce.constrained.automaton.cursor import GrammarCursor
from spruce.constrained.automaton.vocab import TokenVocabulary
from spruce.constrained.core.bitmask import pack_allowed
from spruce.constrained.core.memory import Budgeted, MaskTooExpensive, SharedBudget

if TYPE_CHECKING:
    from spruce.constrained.spec import ConstraintSpec


# A token mask asked for while requests run (on the scheduler thread) may make at most this
# many new DFA states in all (a state took up to 86 us for SmolLM2's vocabulary on the Python
# path, 1-45 us in C; the scheduler spreads the work over steps, see `prepare_mask`); a JSON
# schema's masks make tens to a few hundred. The initial state's mask is made at build time, off the scheduler thread,
# without this bound.
MAX_MASK_NEW_STATES = 4096
QUICK_MASK_NEW_STATES = 64  # what `may_continue` may spend on a mask (the scheduler makes the rest)
MASK_OVERHEAD_BYTES = 600  # a mask's tensor object and its cache entry (measured, roughly)


class CompiledGrammar(Budgeted):
    """States are the lazy DFA's (byte_dfa.py). A state's token mask is computed on first use
    by walking the vocabulary's byte trie from it (token_trie.py: a few ms for a state
    allowing most of a 49k vocabulary, far less elsewhere) and cached; the caches only grow,
    with identical values, so concurrent readers are safe.

    Everything the grammar holds (the NFA, the DFA's rows and state sets, forced bytes,
    masks) is charged to one MemoryBudget of `max_bytes` (and to `shared`, the compiler's
    budget for all live grammars): a request whose walk would pass it gets GrammarTooLarge
    (a ConstraintError) and the grammar stays usable for the states it has. `nbytes` is
    what it holds now (the compiler's cache counts it)."""

    backend = "spruce"

    def __init__(
        self, spec: ConstraintSpec, nfa: ByteNFA, vocab: TokenVocabulary, max_bytes: int = MAX_BYTES,
        shared: SharedBudget | None = None,
    ) -> None:  # fmt: skip
        self.spec = spec
        self.regex = spec.regex
        self.vocab = vocab
        super().__init__(max_bytes, shared)
        self.budget.charge(nfa.nbytes + sys.getsizeof(spec.value) + sys.getsizeof(spec.regex))
        self.dfa = ByteDFA(nfa, self.budget)
        self.initial_state = self.dfa.initial
        self.mask_new_states = MAX_MASK_NEW_STATES
        self._states: dict[int, _StateInfo] = {}
        self._mask_work: dict[int, int] = {}  # new DFA states made so far by unfinished masks

    @property
    def work(self) -> int:
        """Mask work done so far: DFA states made (the scheduler's per-step budget)."""
        return self.dfa.num_states

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
        return self._state_info(state, self._mask_room(state)).mask

    def has_continuation(self, state: int) -> bool:
        """Whether some non-EOS token is allowed in `state`."""
        return self._state_info(state, self._mask_room(state)).has_continuation

    def may_continue(self, state: int) -> bool:
        """Whether some non-EOS token may follow `state`, at a bounded cost: exact when its
        mask is made (here, if that takes at most QUICK_MASK_NEW_STATES new DFA states);
        otherwise whether some byte can follow (the mask, finished before the request's
        next step, then allows EOS alone if the vocabulary cannot go on)."""
        if self.prepare_mask(state, QUICK_MASK_NEW_STATES):
            return self._states[state].has_continuation
        return bool((self.dfa.ensure_rows((state,))[state] >= 0).any())

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every output from `state` continues with (see ByteDFA.forced_bytes)."""
        return self.dfa.forced_bytes(state)

    def has_mask(self, state: int) -> bool:
        """Whether `state`'s mask is made already (asking for it costs a lookup)."""
        return state in self._states

    def warm(self, state: int | None = None) -> None:
        """Makes `state`'s mask (default: the initial state's) without the per-mask work
        bound (for the build thread)."""
        self._state_info(self.initial_state if state is None else state, None)

    def prepare_mask(self, state: int, max_new_states: int) -> bool:
        """Makes `state`'s mask, making at most `max_new_states` new DFA states now; False
        when the walk stopped there (what it made is kept, so the next call resumes it).
        MaskTooExpensive once this mask has made more than `mask_new_states` in all."""
        if state in self._states:
            return True
        room = self._mask_room(state)
        before = self.dfa.num_states
        try:
            self._state_info(state, min(room, max_new_states))
        except MaskTooExpensive:
            if max_new_states >= room:
                raise
            self._mask_work[state] = self._mask_work.get(state, 0) + self.dfa.num_states - before
            return False
        self._mask_work.pop(state, None)
        return True

    def _mask_room(self, state: int) -> int:
        """New DFA states `state`'s mask may still make (see prepare_mask)."""
        return self.mask_new_states - self._mask_work.get(state, 0)

    def _state_info(self, state: int, max_new_states: int | None) -> _StateInfo:
        """The state's mask, made now if needed with at most `max_new_states` new DFA
        states (None: no bound)."""
        info = self._states.get(state)
        if info is None:
            allowed = self.vocab.trie.allowed(self.dfa, state, max_new_states)  # bool [vocab]
            has_continuation = bool(allowed.any())
            if self.dfa.is_accepting(state):
                allowed[sorted(self.vocab.eos_token_ids)] = True
            mask = pack_allowed(allowed)
            self.budget.charge(mask.numel() * mask.element_size() + MASK_OVERHEAD_BYTES)
            info = self._states[state] = _StateInfo(mask, has_continuation)
            self._mask_work.pop(state, None)
        return info


class _StateInfo(NamedTuple):
    mask: torch.Tensor
    has_continuation: bool
