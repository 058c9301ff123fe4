"""The DFA of a ByteNFA, determinized lazily: a state (a set of NFA states) and its row of
256 transitions are made the first time a walk reaches them, so a regex costs what its
requests visit, never the whole automaton (a schema's DFA can have millions of states;
a request visits a few hundred, plus those its token masks' walks pass through).

Every state can still reach acceptance (the NFA was pruned), so a transition that
exists is one a valid output can take. Thread-safe for the runtime's use: rows are only
ever added (with identical values if two threads race), under a lock."""

from __future__ import annotations

import threading

import numpy as np

from spruce.constrained.byte_nfa import ByteNFA
from spruce.constrained.errors import ConstraintError

DEAD = -1  # no transition
UNKNOWN = -2  # row not computed yet
MAX_STATES = 200_000  # ~200 MB of rows; a request needing more fails with a clear error
MAX_FORCED_BYTES = 4096


class ByteDFA:
    def __init__(self, nfa: ByteNFA, max_states: int = MAX_STATES) -> None:
        self._nfa, self._final = nfa, nfa.final
        self.max_states = max_states
        self._ids: dict[frozenset[int], int] = {}
        self._cores: list[tuple[int, ...]] = []  # per DFA state: its NFA states that read bytes
        self._accepting: list[bool] = []
        self._after: dict[frozenset[int], int] = {}  # NFA targets of a byte -> DFA state
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

    def ensure_rows(self, states) -> np.ndarray:
        """Computes the missing rows of `states`; returns the table (which may have grown)."""
        missing = [int(s) for s in states if self.table[s, 0] == UNKNOWN]
        if missing:
            with self._lock:
                for state in missing:
                    if self.table[state, 0] == UNKNOWN:
                        self._compute_row(state)
        return self.table

    def forced_bytes(self, state: int) -> bytes:
        """The bytes every continuation from `state` starts with, up to the first choice:
        an accepting state (the output may end) or more than one live byte. Cached."""
        forced = self._forced.get(state)
        if forced is None:
            forced = self._forced[state] = self._forced_chain(state)
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
            state = len(self._cores)
            if state >= self.max_states:
                raise ConstraintError(
                    f"the constraint's automaton passed {self.max_states} states; simplify it"
                )
            self._ids[key] = state
            edge_at = self._nfa.edge_at
            self._cores.append(tuple(s for s in closure if edge_at[s + 1] > edge_at[s]))
            self._accepting.append(self._final in closure)
            if state >= self.table.shape[0]:
                grown = np.full((2 * self.table.shape[0], 256), UNKNOWN, dtype=np.int32)
                grown[: self.table.shape[0]] = self.table
                self.table = grown
        self._after[targets] = state
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
