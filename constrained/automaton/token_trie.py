"""The vocabulary as a byte trie, and the tokens a DFA state allows: one walk of the trie
from that state, level by level (all nodes of one depth at once, in NumPy), cut wherever
the DFA has no transition. A state inside a free string (most of the vocabulary allowed)
walks most of the trie: a few milliseconds for 49k tokens.

The walk's cost is the DFA rows it has to make: a state of `.*a.{24}` meets a new DFA
state at nearly every trie node (5,000 of them, 0.45 s, for one mask of SmolLM2's
vocabulary). `max_new_states` bounds that work: past it the walk stops with
MaskTooExpensive, before it makes more.

With a NativeByteDFA (byte_dfa.py) the whole walk runs in C, also level by level (automaton.c): the
same tokens, the same rows made, a fraction of the time."""

from __future__ import annotations

import numpy as np

from spruce.constrained.automaton.byte_dfa import UNKNOWN, ByteDFA, NativeByteDFA
from spruce.constrained.core.memory import MaskTooExpensive

SMALL_FRONTIER = 64  # past depth 8, this few (node, state) pairs are walked on in plain Python


def _dict_trie(strings: list[bytes]) -> tuple[list[dict[int, int]], list[bytes]]:
    """(children of each node by byte, the bytes each node spells); node 0 is the root."""
    children: list[dict[int, int]] = [{}]
    ends: list[bytes] = [b""]
    for data in strings:
        node = 0
        for i, byte in enumerate(data):
            nxt = children[node].get(byte)
            if nxt is None:
                nxt = children[node][byte] = len(children)
                children.append({})
                ends.append(data[: i + 1])
            node = nxt
    return children, ends


class TokenTrie:
    """Nodes numbered breadth first (root 0), so the children of a node are consecutive and
    every depth is one range. `token_bytes[i]` empty: token i is never allowed. Immutable."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        children, ends = _dict_trie(sorted({data for data in token_bytes if data}))
        order, level = [0], [0]  # renumbered breadth first
        while level:
            level = [child for node in level for _, child in sorted(children[node].items())]
            order.extend(level)
        number = np.empty(len(order), dtype=np.int64)
        number[order] = np.arange(len(order))
        self.num_nodes = len(order)
        self.byte = np.zeros(self.num_nodes, dtype=np.int64)
        self.child_start = np.zeros(self.num_nodes, dtype=np.int64)
        self.child_count = np.zeros(self.num_nodes, dtype=np.int64)
        node_of: dict[bytes, int] = {}
        for old in order:
            new = number[old]
            kids = sorted(children[old].items())
            self.child_count[new] = len(kids)
            if kids:
                self.child_start[new] = number[kids[0][1]]
            for byte, kid in kids:
                self.byte[number[kid]] = byte
            node_of[ends[old]] = int(new)
        self._lists = (self.child_start.tolist(), self.child_count.tolist(), self.byte.tolist())
        # token -> its node; never-allowed tokens point at an extra node that is never alive
        self.token_node = np.array(
            [node_of[d] if d else self.num_nodes for d in token_bytes], dtype=np.int64
        )
        self._native = self._native_arrays()  # what the C walk reads (NativeByteDFA.token_mask)
        addresses = [a.ctypes.data for a in self._native]
        self.native_args = (*addresses[:3], self.num_nodes, *addresses[3:], len(token_bytes))

    def _native_arrays(self) -> tuple[np.ndarray, ...]:
        """The trie, each token's node and each node's tokens (node n's are
        node_tokens[node_token_at[n]:node_token_at[n + 1]]), as the C walk reads them."""
        node_tokens = np.argsort(self.token_node, kind="stable").astype(np.int32)
        per_node = np.bincount(self.token_node, minlength=self.num_nodes + 1)[: self.num_nodes]
        node_token_at = np.concatenate([[0], np.cumsum(per_node)]).astype(np.int32)
        trie = (
            self.child_start.astype(np.int32),
            self.child_count.astype(np.int32),
            self.byte.astype(np.uint8),
        )
        return (*trie, self.token_node.astype(np.int32), node_token_at, node_tokens)

    def allowed(self, dfa: ByteDFA, state: int, max_new_states: int | None = None) -> np.ndarray:
        """bool [num tokens]: the tokens whose bytes the DFA reads from `state`;
        MaskTooExpensive once the walk has made more than `max_new_states` DFA states."""
        limit = None if max_new_states is None else dfa.num_states + max_new_states
        if isinstance(dfa, NativeByteDFA):
            return dfa.token_mask(self.native_args, state, -1 if limit is None else max(limit, 0))
        alive = np.zeros(self.num_nodes + 1, dtype=bool)
        nodes = np.zeros(1, dtype=np.int64)
        states = np.array([state], dtype=np.int64)
        depth = 0
        while nodes.size:
            depth += 1
            if depth > 8 and nodes.size <= SMALL_FRONTIER:  # the deep, thin levels of long tokens
                self._walk_rest(dfa, nodes.tolist(), states.tolist(), alive, limit)
                break
            counts = self.child_count[nodes]
            total = int(counts.sum())
            if total == 0:
                break
            parent = np.repeat(np.arange(nodes.size), counts)
            first = np.cumsum(counts) - counts
            children = self.child_start[nodes][parent] + (np.arange(total) - first[parent])
            parent_states = states[parent]
            table = dfa.table
            missing = parent_states[table[parent_states, 0] == UNKNOWN]
            if missing.size:
                table = dfa.ensure_rows(np.unique(missing), limit)
            nxt = table[parent_states, self.byte[children]]
            keep = nxt >= 0
            nodes, states = children[keep], nxt[keep].astype(np.int64)
            alive[nodes] = True
        return alive[self.token_node]

    def _walk_rest(
        self,
        dfa: ByteDFA,
        nodes: list[int],
        states: list[int],
        alive: np.ndarray,
        limit: int | None,
    ) -> None:
        """Depth first below `nodes` (each in its DFA state), marking the nodes reached."""
        child_start, child_count, byte = self._lists
        stack = list(zip(nodes, states))
        while stack:
            node, state = stack.pop()
            first = child_start[node]
            if limit is not None and dfa.num_states > limit:
                raise MaskTooExpensive
            for child in range(first, first + child_count[node]):
                nxt = dfa.step(state, byte[child])
                if nxt >= 0:
                    alive[child] = True
                    stack.append((child, nxt))
