"""Cache-aware routing of requests over data-parallel replicas.

Each replica (a scheduler process with its own KV pool and radix cache) caches the prompts
it ran. The router keeps an approximate copy of those caches: one token trie shared by all
replicas, where each node records which replicas hold it and when they last used it. The
policy is the one SGLang's router uses:

1. If the load is unbalanced (the busiest replica has more than `balance_abs_threshold`
   requests more than the idlest AND more than `balance_rel_threshold` times as many),
   send the request to the least-loaded replica.
2. Otherwise send it to the replica holding the longest prefix of its tokens, if that
   prefix covers more than `cache_threshold` of the prompt; else to the replica whose
   approximate cache is smallest (the most room), ties to the least loaded.

The chosen replica's entry is then updated with the whole prompt. Each replica's entry is
bounded (`max_tokens_per_replica`); past it, its least recently used leaves are forgotten.
The trie is approximate by design: it never asks the replicas, so it can be wrong after
their own evictions, which only costs a cache miss.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouterOptions:
    cache_threshold: float = 0.5  # share of the prompt a replica must hold to win on cache
    balance_abs_threshold: int = 32  # requests: imbalance below this never overrides the cache
    balance_rel_threshold: float = 1.5  # ... nor does a busiest/idlest ratio below this
    max_tokens_per_replica: int = 1 << 20  # bound of each replica's approximate cache


@dataclass(eq=False, slots=True)
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    parent: _Node | None = None
    token: int = -1
    used: dict[int, int] = field(default_factory=dict)  # replica -> tick of its last use


class CacheAwareRouter:
    def __init__(self, num_replicas: int, options: RouterOptions | None = None) -> None:
        assert num_replicas >= 1
        self.num_replicas = num_replicas
        self.options = options or RouterOptions()
        self.root = _Node()
        self.sizes = [0] * num_replicas  # tokens each replica holds in the trie
        self.alive = [True] * num_replicas
        self.tick = 0

    def route(self, ids: list[int], loads: list[int]) -> int:
        """The replica for a prompt, given each replica's current load (requests in flight);
        records the prompt as cached there."""
        replica = self.choose(ids, loads)
        self.record(replica, ids)
        return replica

    def choose(self, ids: list[int], loads: list[int]) -> int:
        live = [r for r in range(self.num_replicas) if self.alive[r]]
        assert live, "no live replica"
        least_loaded = min(live, key=lambda r: (loads[r], self.sizes[r]))
        if self._unbalanced([loads[r] for r in live]):
            return least_loaded
        matched = self.matched_lengths(ids)
        best = max(live, key=lambda r: (matched[r], -loads[r]))
        if ids and matched[best] / len(ids) > self.options.cache_threshold:
            return best
        return min(live, key=lambda r: (self.sizes[r], loads[r]))

    def matched_lengths(self, ids: list[int]) -> list[int]:
        """How many leading tokens of `ids` each replica holds."""
        out = [0] * self.num_replicas
        node = self.root
        for depth, token in enumerate(ids, 1):
            node = node.children.get(token)
            if node is None:
                break
            for replica in node.used:
                out[replica] = depth
        return out

    def record(self, replica: int, ids: list[int]) -> None:
        self.tick += 1
        node = self.root
        for token in ids:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(parent=node, token=token)
            if replica not in child.used:
                self.sizes[replica] += 1
            child.used[replica] = self.tick
            node = child
        if self.sizes[replica] > self.options.max_tokens_per_replica:
            self._evict(
                replica, self.sizes[replica] - self.options.max_tokens_per_replica * 9 // 10
            )

    def forget(self, replica: int) -> None:
        """A replica died or was flushed: nothing is cached there any more."""
        self._evict(replica, self.sizes[replica])

    def mark_dead(self, replica: int) -> None:
        self.alive[replica] = False
        self.forget(replica)

    def _unbalanced(self, loads: list[int]) -> bool:
        busiest, idlest = max(loads), min(loads)
        o = self.options
        return (
            busiest - idlest > o.balance_abs_threshold
            and busiest > o.balance_rel_threshold * idlest
        )

    def _evict(self, replica: int, count: int) -> None:
        """Forgets `count` tokens of the replica, least recently used leaves first."""
        leaves = sorted(self._leaves(replica), key=lambda n: n.used[replica])
        while count > 0 and leaves:
            node = leaves.pop(0)
            while count > 0 and node is not self.root and self._is_leaf_of(node, replica):
                del node.used[replica]
                self.sizes[replica] -= 1
                count -= 1
                parent = node.parent
                if not node.used and not node.children:
                    del parent.children[node.token]
                node = parent

    def _leaves(self, replica: int) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            children = [c for c in node.children.values() if replica in c.used]
            if node is not self.root and not children:
                out.append(node)
            stack.extend(children)
        return out

    @staticmethod
    def _is_leaf_of(node: _Node, replica: int) -> bool:
        return replica in node.used and not any(replica in c.used for c in node.children.values())


class RoundRobinRouter:
    """The baseline the cache-aware router is measured against: live replicas in turn."""

    def __init__(self, num_replicas: int, options: RouterOptions | None = None) -> None:
        self.num_replicas = num_replicas
        self.alive = [True] * num_replicas
        self.next = 0

    def route(self, ids: list[int], loads: list[int]) -> int:
        assert any(self.alive), "no live replica"
        while not self.alive[self.next % self.num_replicas]:
            self.next += 1
        replica = self.next % self.num_replicas
        self.next = replica + 1
        return replica

    def forget(self, replica: int) -> None:
        pass  # it remembers nothing

    def mark_dead(self, replica: int) -> None:
        self.alive[replica] = False


ROUTERS = {"cache-aware": CacheAwareRouter, "round-robin": RoundRobinRouter}


def make_router(policy: str, num_replicas: int, options: RouterOptions | None = None):
    """The router of a --router-policy name; an unknown name is a ValueError listing the known."""
    if policy not in ROUTERS:
        raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(ROUTERS)}")
    return ROUTERS[policy](num_replicas, options)
