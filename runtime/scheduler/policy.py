"""Waiting-queue policies, by name: the order in which waiting requests are admitted."""

from __future__ import annotations

from collections.abc import Callable

from spruce.radix import PrefixCache
from spruce.runtime.core.request import Req
from spruce.runtime.errors import SpruceError

Policy = Callable[[list[Req], PrefixCache, int], list[Req]]


def fcfs(waiting: list[Req], cache: PrefixCache, max_queue: int) -> list[Req]:
    return list(waiting)


def longest_prefix_match(waiting: list[Req], cache: PrefixCache, max_queue: int) -> list[Req]:
    """Longest cached prefix first; beyond `max_queue` waiting requests the matching costs
    more than it saves, so fall back to arrival order."""
    if len(waiting) > max_queue:
        return list(waiting)
    matched = {id(r): cache.match_prefix(r.all_ids()).slots.numel() for r in waiting}
    return sorted(waiting, key=lambda r: -matched[id(r)])


def dfs_weight(waiting: list[Req], cache: PrefixCache, max_queue: int) -> list[Req]:
    """Depth-first walk of the tree, heavier subtrees first, so siblings run together."""
    if len(waiting) > max_queue:
        return list(waiting)
    nodes = [cache.match_prefix(r.all_ids()).last_node for r in waiting]
    return [waiting[i] for i in cache.order_by_tree(nodes)]


POLICIES: dict[str, Policy] = {"fcfs": fcfs, "lpm": longest_prefix_match, "dfs-weight": dfs_weight}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise SpruceError(
            f"unknown schedule policy {name!r} (known: {', '.join(POLICIES)})"
        ) from None
