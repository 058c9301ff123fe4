"""The DFA of a ByteNFA, determinized lazily: a state (a set of NFA states) and its row of
256 transitions are made the first time a walk reaches them, so a regex costs what its
requests visit, never the whole automaton (a schema's DFA can have millions of states;
a request visits a few hundred, plus those its token masks' walks pass through).

Every state can still reach acceptance (the NFA was pruned), so a transition that
exists is one a valid output can take. Thread-safe for the runtime's use: rows are only
ever added (with identical values if two threads race), under a lock.

What the DFA holds (its table, the NFA state sets naming its states, the forced-byte
cache) is charged to a MemoryBudget as it grows: a walk that would pass the budget raises
GrammarTooLarge and leaves the DFA as it was (the state it was computing stays unknown).
`.*a.{24}` needs a new state for nearly every byte read, so its token masks' walks would
otherwise grow it by hundreds of MB.

Two implementations behind one interface: `ByteDFA(nfa)` is a NativeByteDFA (the table, the
state sets and the determinization in C, automaton.c via native.py) when the C library loads,
else the Python one below (no C compiler, or SPRUCE_AUTOMATON=python). Both make the same
states for the same walks and give the same answers; the C one counts the bytes it really
allocates instead of the Python objects' estimates."""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
import weakref

import numpy as np

from spruce.constrained.automaton import native
from spruce.constrained.automaton.byte_nfa import ByteNFA
from spruce.constrained.core.memory import MaskTooExpensive, MemoryBudget

DEAD = -1  # no transition
UNKNOWN = -2  # row not computed yet
MAX_BYTES = 256 * 2**20  # the budget of a DFA made without one (the compiler gives its own)
MAX_FORCED_BYTES = 4096
ENTRY_BYTES = 100  # a dict entry or list slot with its small objects (measured, roughly)


class ByteDFA:
    def __new__(cls, nfa: ByteNFA, budget: MemoryBudget | None = None):
        """A NativeByteDFA when the C library is available (see the module's docstring)."""
        native_dfa = cls is ByteDFA and native.library() is not None
        return super().__new__(NativeByteDFA if native_dfa else cls)

    def __init__(self, nfa: ByteNFA, budget: MemoryBudget | None = None) -> None:
        self._nfa, self._final = nfa, nfa.final
        self.budget = budget or MemoryBudget(MAX_BYTES)
        self._ids: dict[frozenset[int], int] = {}
        self._cores: list[tuple[int, ...]] = []  # per DFA state: its NFA states that read bytes
        self._accepting: list[bool] = []
        self._after: dict[frozenset[int], int] = {}  # NFA targets of a byte -> DFA state
        self.budget.charge(64 * 256 * 4)
        self.table = np.full((64, 256), UNKNOWN, dtype=np.int32)
        self._forced: dict[int, bytes] = {}  # forced_bytes per state (asked every decode step)
        self._lock = threading.Lock()
        self.initial = self._intern(frozenset((nfa.start,)))

    @property
    def num_states(self) -> int:
        return len(self._cores)

    def is_accepting(self, state: int) -> bool:
        return self._accepting[state]

    def step(self, state: int, byte: int) -> int:
        """The state after `byte`, DEAD when none."""
        if self.table[state, 0] == UNKNOWN:
            self.ensure_rows((state,))
        return int(self.table[state, byte])

    def walk(self, state: int, data: bytes) -> int:
        for byte in data:
            if state == DEAD:
                break
            state = self.step(state, byte)
        return state

    def ensure_rows(self, states, state_limit: int | None = None) -> np.ndarray:
        """Computes the missing rows of `states`; returns the table (which may have grown).
        MaskTooExpensive once the DFA has more than `state_limit` states."""
        missing = [int(s) for s in states if self.table[s, 0] == UNKNOWN]
        if missing:
            with self._lock:
                for state in missing:
                    if state_limit is not None and self.num_states > state_limit:
                        raise MaskTooExpensive
                    if self.table[state, 0] == UNKNOWN:
                        self._compute_row(state)
        return self.table

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every continuation from `state` starts with, up to the first choice:
        an accepting state (the output may end) or more than one live byte. Cached."""
        forced = self._forced.get(state)
        if forced is None:
            forced = self._forced_chain(state)
            self.budget.charge(sys.getsizeof(forced) + ENTRY_BYTES)
            self._forced[state] = forced
        return forced

    def _forced_chain(self, state: int) -> bytes:
        out, seen = bytearray(), {state}
        while len(out) < MAX_FORCED_BYTES and not self._accepting[state]:
            row = self.ensure_rows((state,))[state]
            live = np.flatnonzero(row >= 0)
            if live.size != 1:
                break
            out.append(int(live[0]))
            state = int(row[live[0]])
            if state in seen:
                break
            seen.add(state)
        return bytes(out)

    # -- determinization ----------------------------------------------------------------------

    def _intern(self, targets: frozenset[int]) -> int:
        """The DFA state of the epsilon closure of `targets` (NFA states)."""
        known = self._after.get(targets)
        if known is not None:
            return known
        closure = self._closure(targets)
        key = frozenset(closure)
        state = self._ids.get(key)
        if state is None:
            state = self._new_state(key)
        self.budget.charge(sys.getsizeof(targets) + ENTRY_BYTES)
        self._after[targets] = state
        return state

    def _new_state(self, key: frozenset[int]) -> int:
        """Adds the DFA state of `key` (an epsilon-closed set of NFA states), charged first."""
        state = len(self._cores)
        edge_at = self._nfa.edge_at
        core = tuple(s for s in key if edge_at[s + 1] > edge_at[s])
        rows = self.table.shape[0]
        grown = 2 * rows if state >= rows else rows
        self.budget.charge(
            sys.getsizeof(key) + sys.getsizeof(core) + 2 * ENTRY_BYTES + (grown - rows) * 256 * 4
        )
        if grown > rows:
            table = np.full((grown, 256), UNKNOWN, dtype=np.int32)
            table[:rows] = self.table
            self.table = table
        self._ids[key] = state
        self._cores.append(core)
        self._accepting.append(self._final in key)
        return state

    def _closure(self, targets: frozenset[int]) -> set[int]:
        eps_at, eps_to = self._nfa.eps_at, self._nfa.eps_to
        seen, stack = set(targets), list(targets)
        while stack:
            state = stack.pop()
            for i in range(eps_at[state], eps_at[state + 1]):
                nxt = eps_to[i]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    def _compute_row(self, state: int) -> None:
        nfa = self._nfa
        edges = [
            (nfa.edge_low[i], nfa.edge_high[i], nfa.edge_to[i])
            for s in self._cores[state] for i in range(nfa.edge_at[s], nfa.edge_at[s + 1])
        ]  # fmt: skip
        row = np.full(256, DEAD, dtype=np.int32)
        if edges:
            cuts = sorted({low for low, _, _ in edges} | {high + 1 for _, high, _ in edges})
            for a, b in itertools.pairwise(cuts):
                targets = frozenset(t for low, high, t in edges if low <= a <= high)
                if targets:
                    row[a:b] = self._intern(targets)
        self.table[state] = row


_SINGLE_BYTES = [bytes((i,)) for i in range(256)]


class NativeByteDFA(ByteDFA):
    """The same DFA with its table, state sets and rows in C (automaton.c). Every C call runs
    under the DFA's lock (ctypes releases the GIL, and a call may move the table). A call is
    given the memory it may still allocate (what the budget has room for); after it, what C
    allocated is charged to the budget. When C stops at that limit, the amount it needed is
    charged, which raises GrammarTooLarge (the DFA keeps the states made, as in Python)."""

    def __init__(self, nfa: ByteNFA, budget: MemoryBudget | None = None) -> None:
        self._lib = lib = native.library()
        self.budget = budget or MemoryBudget(MAX_BYTES)
        self._forced: dict[int, bytes] = {}
        self._lock = threading.Lock()
        self._charged = 0  # the bytes of C memory charged to the budget so far
        arrays = [np.asarray(getattr(nfa, name), dtype=np.int32) for name in _NFA_ARRAYS]
        self._nfa_arrays = arrays  # alive during the call that copies them
        counts = (nfa.num_states, arrays[1].size, arrays[5].size, nfa.start, nfa.final)
        need = ctypes.c_int64()
        self._ptr = lib.spruce_dfa_new(
            *counts, *(a.ctypes.data for a in arrays), self._room(), ctypes.byref(need)
        )
        del self._nfa_arrays
        if not self._ptr:  # past the budget (the charge raises GrammarTooLarge) or out of memory
            if need.value >= 0:
                self.budget.charge(need.value)
            raise MemoryError("the automaton's C library could not allocate its memory")
        weakref.finalize(self, lib.spruce_dfa_free, self._ptr)
        with self._lock:
            self._settle(0)
        self.initial = 0

    @property
    def num_states(self) -> int:
        return self._lib.spruce_dfa_num_states(self._ptr)

    @property
    def table(self) -> _NativeTable:
        """The rows made so far (a view that copies a row out of C when indexed)."""
        return _NativeTable(self)

    def is_accepting(self, state: int) -> bool:
        with self._lock:
            return bool(_checked(self._lib.spruce_dfa_is_accepting(self._ptr, state)))

    def step(self, state: int, byte: int) -> int:
        return self.walk(state, _SINGLE_BYTES[byte])

    def walk(self, state: int, data: bytes) -> int:
        if state == DEAD:
            return DEAD
        data = bytes(data)
        return self._call(self._lib.spruce_dfa_walk, state, data, len(data))

    def ensure_rows(self, states, state_limit: int | None = None) -> _NativeTable:
        wanted = np.ascontiguousarray(np.asarray(states, dtype=np.int32).reshape(-1))
        limit = -1 if state_limit is None else max(state_limit, 0)  # -1: no bound
        self._call(self._lib.spruce_dfa_ensure_rows, wanted.ctypes.data, wanted.size, limit)
        return self.table

    def token_mask(self, trie_args: tuple, state: int, limit: int) -> np.ndarray:
        """bool [num tokens]: TokenTrie.allowed walked in C (`trie_args`: TokenTrie.native_args,
        the trie's arrays' addresses and sizes, its last item the number of tokens)."""
        out = np.empty(trie_args[-1], dtype=bool)
        self._call(self._lib.spruce_dfa_mask, state, limit, *trie_args, out.ctypes.data)
        return out

    def _forced_chain(self, state: int) -> bytes:
        out = ctypes.create_string_buffer(MAX_FORCED_BYTES)
        length = self._call(self._lib.spruce_dfa_forced, state, out, MAX_FORCED_BYTES)
        return out.raw[:length]

    def _room(self) -> int:
        """The C memory this DFA may hold in all: what it has charged plus the budget's room."""
        budget, room = self.budget, self.budget.max_bytes - self.budget.used
        if budget.shared is not None:
            room = min(room, budget.shared.max_bytes - budget.shared.used)
        return self._charged + max(room, 0)

    def _call(self, fn, *args):
        """fn(dfa, *args, memory limit) under the lock; its result, after charging what it
        allocated. MaskTooExpensive on ERR_LIMIT; on ERR_MEMORY the need is charged (raising
        GrammarTooLarge when it does not fit) and the call run again with that much more room
        (a rerun redoes nothing: the rows made are kept; a call may need several, its scratch
        being allocated piece by piece)."""
        with self._lock:
            while True:
                result = fn(self._ptr, *args, self._room())
                if self._settle(result):
                    return result

    def _settle(self, result: int) -> bool:
        """Charges what C allocated since the last call; False when `result` is ERR_MEMORY
        (after charging what it needed, which raises GrammarTooLarge past the budget)."""
        allocated = self._lib.spruce_dfa_allocated(self._ptr)
        if allocated > self._charged:
            self.budget.charge(allocated - self._charged)
            self._charged = allocated
        _checked(result)
        if result == native.ERR_LIMIT:
            raise MaskTooExpensive
        if result == native.ERR_MEMORY:
            needed = self._lib.spruce_dfa_needed(self._ptr)
            if needed < 0:
                raise MemoryError("the automaton's C library could not allocate its memory")
            self.budget.charge(needed)
            self._charged += needed  # paid ahead: the retry may allocate it
            return False
        return True


def _checked(result: int) -> int:
    """`result` of a C call, IndexError when it names a state the DFA does not have."""
    if result == native.ERR_STATE:
        raise IndexError("not a state of this DFA")
    return result


_NFA_ARRAYS = ("edge_at", "edge_low", "edge_high", "edge_to", "eps_at", "eps_to")


class _NativeTable:
    """The rows of a NativeByteDFA, as `ensure_rows` returns them: `table[state]` is a copy of
    that row (int32 [256]); `nbytes` what the allocated rows hold."""

    def __init__(self, dfa: NativeByteDFA) -> None:
        self._dfa = dfa

    @property
    def nbytes(self) -> int:
        return self._dfa.num_states * 256 * 4

    def __getitem__(self, state: int) -> np.ndarray:
        row = np.empty(256, dtype=np.int32)
        with self._dfa._lock:
            _checked(
                self._dfa._lib.spruce_dfa_copy_row(self._dfa._ptr, int(state), row.ctypes.data)
            )
        return row
