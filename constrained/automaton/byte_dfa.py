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
otherwise grow it by hundreds of MB."""

from __future__ import annotations

import sys
import threading

import numpy as np

from spruce.constrained.automaton.byte_nfa import ByteNFA
from spruce.constrained.core.memory import MaskTooExpensive, MemoryBudget

DEAD = -1  # no transition
UNKNOWN = -2  # row not computed yet
MAX_BYTES = 256 * 2**20  # the budget of a DFA made without one (the compiler gives its own)
MAX_FORCED_BYTES = 4096
ENTRY_BYTES = 100  # a dict entry or list slot with its small objects (measured, roughly)


class ByteDFA:
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
            for a, b in zip(cuts, cuts[1:]):
                targets = frozenset(t for low, high, t in edges if low <= a <= high)
                if targets:
                    row[a:b] = self._intern(targets)
        self.table[state] = row
