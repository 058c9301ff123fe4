"""The prefix-cache interface: token ids -> KV slot indices, shared between requests.

A prefix cache stores token sequences together with the KV slot of every token (a 1-D
int64 CPU tensor, one slot per token). It owns the slots it stores and gives them back to
the KV pool (anything with `.free(slots)`, e.g. `SlotAllocator` or `KVPool`) when it
evicts them. The scheduler uses it like this:

    match = cache.match_prefix(prompt_ids)      # reuse match.slots, compute the rest
    cache.lock(match.last_node)                 # while the request runs
    ...
    # when the request finishes (all_slots starts with match.slots):
    cached = cache.insert(all_ids, all_slots)
    pool.free(all_slots[len(match.slots):cached])  # own slots that duplicate cached ones
    cache.unlock(match.last_node)
    cache.evict(tokens_needed)                  # when the pool runs short
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch


class SlotPool(Protocol):
    """What the cache needs from the KV pool: a way to give slots back."""

    def free(self, slots: torch.Tensor) -> None: ...


class MatchResult(NamedTuple):
    """`slots` of the longest cached prefix of the ids (int64, possibly empty) and the node
    where that prefix ends (the cache's root when nothing matched): the lock handle."""

    slots: torch.Tensor
    last_node: Any


class SizeInfo(NamedTuple):
    """Token counts; `cached_tokens == evictable_tokens + locked_tokens`."""

    cached_tokens: int
    evictable_tokens: int
    locked_tokens: int


def empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class PrefixCache(ABC):
    """Base class of the prefix caches. Rules every implementation keeps:

    - Every slot it stores is owned by it and freed through the pool exactly once, by
      `evict` or `reset`; no slot is stored twice.
    - `match_prefix` never changes which tokens and slots are stored.
    - A locked node, and every node on its path to the root, is never evicted.
    - `evictable_tokens` and `size_info()` are O(1).
    """

    root: Any
    evicted_tokens: int  # cumulative number of tokens freed by `evict`

    @abstractmethod
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        """The slots of the longest cached prefix of `ids` and the node where it ends.

        May split a node so that `last_node` ends exactly at the match, and may mark the
        path as recently used; never adds or removes stored tokens."""

    @abstractmethod
    def insert(self, ids: Sequence[int], slots: torch.Tensor) -> int:
        """Stores `ids -> slots` (`len(slots) == len(ids)`) and returns how many leading
        tokens were already cached. The cache takes ownership of `slots[returned:]`;
        `slots[:returned]` stay the caller's, who frees those it allocated itself (they
        duplicate cached slots) but not those it got from `match_prefix` and kept locked
        (they are the cached slots)."""

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Adds a reference to `node` and every node above it: none of them is evicted
        until the matching `unlock`. Locking the root does nothing."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Drops a reference taken by `lock(node)`; unlocking an unlocked node is an error."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Frees least-recently-used unlocked tokens (whole leaves, repeatedly) through the
        pool until at least `num_tokens` are freed or nothing evictable is left; returns
        the number of tokens freed."""

    @property
    @abstractmethod
    def evictable_tokens(self) -> int:
        """Cached tokens that `evict` could free now (not locked)."""

    @abstractmethod
    def size_info(self) -> SizeInfo:
        """Cached, evictable and locked token counts."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Asserts the internal invariants (structure, counters, slot lengths, no slot twice)."""

    @abstractmethod
    def reset(self) -> None:
        """Frees every cached slot and empties the cache; nothing may be locked."""

    @abstractmethod
    def order_by_tree(self, last_nodes: list[Any]) -> list[int]:
        """Scheduling helper ("dfs-weight"): given the `last_node` of each waiting request
        (from `match_prefix`), returns the request indices in the order of a depth-first
        walk of the tree that visits heavier children first (weight = number of waiting
        requests at or below a node); a node's own requests come when it is visited.
        Requests that share a prefix thus run close together."""
