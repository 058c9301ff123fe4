"""RadixAttention's prefix cache: a radix tree over token ids whose values are KV slots.

Each edge holds a run of tokens (`key`, a tuple of ints) and their slots (`value`, an int64
tensor of the same length); children are keyed by the first token of their edge. A partial
match splits a node so that every match ends exactly at a node. Recency is a monotonically
increasing access counter stamped on the whole path of every match and insert, so a
parent's stamp is never older than its children's. Eviction frees least-recently-used
unlocked leaves, taken from a heap.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from spruce.radix.base import MatchResult, PrefixCache, SizeInfo, SlotPool, empty_slots


@dataclass(slots=True, eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    value: torch.Tensor = field(default_factory=empty_slots, repr=False)
    parent: RadixNode | None = field(default=None, repr=False)
    children: dict[int, RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # locks held on this node or any node below it
    last_access: int = 0


def as_key(ids: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(ids, torch.Tensor):
        return tuple(ids.tolist())
    return tuple(ids)


def common_prefix_len(key: tuple[int, ...], ids: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `key` and `ids[start:]`, compared in C slices."""
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start : start + n]:
        return n
    low, high = 0, n  # key[:low] matches; the first mismatch is in [low, high)
    while high - low > 1:
        mid = (low + high) // 2
        if key[low:mid] == ids[start + low : start + mid]:
            low = mid
        else:
            high = mid
    return low


class RadixCache(PrefixCache):
    """Token-granular radix-tree prefix cache; see `PrefixCache` for the contract."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.root = RadixNode()
        self.leaves: set[RadixNode] = set()
        self.cached_tokens = 0
        self.locked_tokens = 0
        self.evicted_tokens = 0
        self._clock = 0

    # ---- matching and inserting -------------------------------------------------------

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        node, _, path = self._walk(as_key(ids))
        slots = torch.cat([n.value for n in path]) if path else empty_slots()
        return MatchResult(slots, node)

    def insert(self, ids: Sequence[int], slots: torch.Tensor) -> int:
        key = as_key(ids)
        assert slots.dtype == torch.int64 and slots.shape == (len(key),), (
            f"insert needs one int64 slot per token: {len(key)} ids, slots {tuple(slots.shape)}"
        )
        node, matched, _ = self._walk(key)
        if matched < len(key):
            self._add_leaf(node, key[matched:], slots[matched:].clone())
        return matched

    def _walk(self, key: tuple[int, ...]) -> tuple[RadixNode, int, list[RadixNode]]:
        """Follows `key` down the tree, splitting the last edge on a partial match; stamps
        the path as used. Returns the node where the match ends, its length, the path."""
        self._clock += 1
        node, matched, path = self.root, 0, []
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            common = common_prefix_len(child.key, key, matched)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            path.append(child)
            node, matched = child, matched + common  # after a split the loop ends here
        return node, matched, path

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cuts `node`'s edge after `at` tokens; the new upper node is returned. The lower
        part stays the same object, so lock handles keep ending where they ended."""
        assert 0 < at < len(node.key), f"split at {at} of a {len(node.key)}-token edge"
        upper = RadixNode(
            key=node.key[:at],
            value=node.value[:at],
            parent=node.parent,
            children={node.key[at]: node},
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.parent.children[node.key[0]] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        return upper

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], value: torch.Tensor) -> None:
        leaf = RadixNode(key=key, value=value, parent=parent, last_access=self._clock)
        parent.children[key[0]] = leaf
        self.leaves.discard(parent)
        self.leaves.add(leaf)
        self.cached_tokens += len(key)

    # ---- locking ----------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        assert node is self.root or node.parent.children.get(node.key[0]) is node, (
            "lock of a node that is no longer in the tree (match again after evict/reset)"
        )
        while node is not self.root:
            if node.lock_ref == 0:
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent

    # ---- eviction ---------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        tie = itertools.count()  # heap entries never compare nodes
        heap = [(n.last_access, next(tie), n) for n in self.leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        evicted: list[torch.Tensor] = []
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            evicted.append(self._remove_leaf(leaf))
            freed += len(leaf.key)
            parent = leaf.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        if evicted:
            self.pool.free(torch.cat(evicted))  # one call: a pool free can cost O(pool)
        self.evicted_tokens += freed
        return freed

    def _remove_leaf(self, leaf: RadixNode) -> torch.Tensor:
        """Unhooks an unlocked leaf and returns its slots, for the caller to free. The
        leaf keeps its `parent` link, so a stale handle still walks up to the root."""
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        self.leaves.discard(leaf)
        if parent is not self.root and not parent.children:
            self.leaves.add(parent)
        self.cached_tokens -= len(leaf.key)
        return leaf.value

    def reset(self) -> None:
        assert self.locked_tokens == 0, f"reset with {self.locked_tokens} locked tokens"
        slots = [node.value for node in self._nodes()]
        if slots:
            self.pool.free(torch.cat(slots))
        self.root.children.clear()  # the root object stays: old handles still reach it
        self.leaves.clear()
        self.cached_tokens = 0

    # ---- sizes and checks -------------------------------------------------------------

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.locked_tokens

    def size_info(self) -> SizeInfo:
        return SizeInfo(self.cached_tokens, self.evictable_tokens, self.locked_tokens)

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check_integrity(self) -> None:
        nodes = self._nodes()
        for node in nodes:
            self._check_node(node)
        assert self.leaves == {n for n in nodes if not n.children}, "leaf set out of date"
        assert self.cached_tokens == sum(len(n.key) for n in nodes), "cached count wrong"
        locked = sum(len(n.key) for n in nodes if n.lock_ref > 0)
        assert self.locked_tokens == locked, "locked count wrong"
        slots = torch.cat([n.value for n in nodes]) if nodes else empty_slots()
        assert slots.unique().numel() == slots.numel(), "a slot is cached twice"
        assert not bool((slots == 0).any()), "the padding slot 0 is cached"

    def _check_node(self, node: RadixNode) -> None:
        parent = node.parent
        assert len(node.key) > 0 and parent.children.get(node.key[0]) is node
        assert node.value.dtype == torch.int64 and node.value.shape == (len(node.key),)
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0
        if parent is not self.root:
            assert parent.last_access >= node.last_access, "child used after its parent"

    # ---- scheduling -------------------------------------------------------------------

    def order_by_tree(self, last_nodes: list[RadixNode]) -> list[int]:
        here, weight, below = _weigh(last_nodes)
        order: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            order.extend(here.get(node, ()))
            children = sorted(below.get(node, ()), key=weight.__getitem__, reverse=True)
            stack.extend(reversed(children))  # heaviest on top; ties in first-seen order
        return order


def _weigh(last_nodes: list[RadixNode]) -> tuple[dict, dict, dict]:
    """Per node: the requests sitting on it, its weight (requests at or below it), and
    its children that have requests below them, in the order they were first seen."""
    here: dict[RadixNode, list[int]] = {}
    weight: dict[RadixNode, int] = {}
    below: dict[RadixNode, list[RadixNode]] = {}
    for index, node in enumerate(last_nodes):
        here.setdefault(node, []).append(index)
        while node is not None:
            if node not in weight:
                weight[node] = 0
                if node.parent is not None:
                    below.setdefault(node.parent, []).append(node)
            weight[node] += 1
            node = node.parent
    return here, weight, below
