"""A prefix cache that shares nothing: the baseline to compare the radix cache against."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spruce.radix.base import MatchResult, PrefixCache, SizeInfo, SlotPool, empty_slots


class NoPrefixCache(PrefixCache):
    """Caches nothing: every match is empty, and `insert` frees every slot it is given
    (it takes ownership of all of them and returns 0)."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.root = None
        self.evicted_tokens = 0

    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        return MatchResult(empty_slots(), self.root)

    def insert(self, ids: Sequence[int], slots: torch.Tensor) -> int:
        assert slots.numel() == len(ids), f"{len(ids)} ids but {slots.numel()} slots"
        self.pool.free(slots)
        return 0

    def lock(self, node: None) -> None:
        pass

    def unlock(self, node: None) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    @property
    def evictable_tokens(self) -> int:
        return 0

    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0, 0)

    def check_integrity(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def order_by_tree(self, last_nodes: list[None]) -> list[int]:
        return list(range(len(last_nodes)))
