"""The radix prefix cache: unit tests and a hypothesis state machine against a reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from spruce.radix import NoPrefixCache, RadixCache
from spruce.runtime.executor.kv_pool import SlotAllocator


class RecordingPool:
    """A `SlotAllocator` that remembers which slots were freed through it."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed.extend(slots.tolist())
        self.allocator.free(slots)


def make_cache(capacity: int = 64) -> tuple[RadixCache, SlotAllocator]:
    allocator = SlotAllocator(capacity + 1)
    return RadixCache(allocator), allocator


def insert_new(cache: RadixCache, allocator: SlotAllocator, ids: list[int]) -> torch.Tensor:
    """Inserts `ids` with fresh slots, frees the duplicates; returns the slots it used."""
    slots = allocator.alloc(len(ids))
    cached = cache.insert(ids, slots)
    allocator.free(slots[:cached])
    return slots


def ancestors(node) -> list:
    path = []
    while node is not None:
        path.append(node)
        node = node.parent
    return path


def check_tree_order(last_nodes: list, order: list[int]) -> None:
    """`order` is a depth-first walk: every subtree's requests are contiguous, a node's
    own requests come first, and sibling subtrees come heaviest first."""
    assert sorted(order) == list(range(len(last_nodes)))
    position = {request: i for i, request in enumerate(order)}
    blocks: dict = {}
    for request, node in enumerate(last_nodes):
        for above in ancestors(node):
            blocks.setdefault(above, []).append(position[request])
    for node, block in blocks.items():
        block.sort()
        assert block == list(range(block[0], block[0] + len(block))), "not a subtree"
        own = sorted(position[r] for r, n in enumerate(last_nodes) if n is node)
        assert own == block[: len(own)], "a node's own requests come first"
        children = sorted((b for n, b in blocks.items() if n.parent is node), key=min)
        sizes = [len(b) for b in children]
        assert sizes == sorted(sizes, reverse=True), "a lighter sibling came first"


# ---- unit tests ---------------------------------------------------------------------------


def test_partial_match_splits_node_without_changing_contents():
    cache, allocator = make_cache()
    slots = insert_new(cache, allocator, [1, 2, 3, 4])
    match = cache.match_prefix([1, 2, 9])
    assert match.slots.tolist() == slots[:2].tolist()
    assert match.last_node.key == (1, 2) and list(match.last_node.children) == [3]
    assert cache.size_info().cached_tokens == 4
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()
    assert cache.match_prefix([7]).last_node is cache.root
    cache.check_integrity()


def test_insert_returns_cached_count_and_keeps_old_slots():
    cache, allocator = make_cache()
    old = insert_new(cache, allocator, [1, 2, 3])
    new = allocator.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], new) == 3
    allocator.free(new[:3])
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == old.tolist() + new[3:].tolist()
    assert cache.insert(torch.tensor([1, 2]), allocator.alloc(2)[:2]) == 2  # tensor ids too
    allocator.check_integrity(held=5 + 2)


def test_lock_protects_the_path_from_eviction():
    cache, allocator = make_cache()
    insert_new(cache, allocator, [1, 2, 3])
    insert_new(cache, allocator, [1, 2, 4, 5])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.lock(node)
    assert cache.size_info() == (5, 2, 3)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 4, 5]).slots.numel() == 2
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 3
    cache.unlock(node)
    assert cache.evictable_tokens == 3 and cache.evict(3) == 3
    assert cache.evicted_tokens == 5
    allocator.check_integrity(held=0)
    with pytest.raises(AssertionError):
        cache.unlock(node)


def test_evicts_least_recently_used_leaf_first():
    cache, allocator = make_cache()
    for first in (1, 2, 3):
        insert_new(cache, allocator, [first, 9])
    cache.match_prefix([1, 9])  # 2 is now the oldest, then 3
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 9]).slots.numel() == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 9]).slots.numel() == 0
    assert cache.match_prefix([1, 9]).slots.numel() == 2


def test_parent_becomes_evictable_after_its_children():
    cache, allocator = make_cache()
    insert_new(cache, allocator, [1, 2, 3])
    insert_new(cache, allocator, [1, 2, 4])
    assert cache.evict(3) == 4  # leaves 3 and 4, then their parent [1, 2]
    assert cache.size_info() == (0, 0, 0)
    cache.check_integrity()


def test_stale_handle_and_bad_slots_are_refused():
    cache, allocator = make_cache()
    insert_new(cache, allocator, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(AssertionError):
        cache.lock(node)
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], allocator.alloc(2))


def test_reset_frees_everything_and_refuses_when_locked():
    cache, allocator = make_cache()
    insert_new(cache, allocator, [1, 2, 3])
    insert_new(cache, allocator, [4, 5])
    node = cache.match_prefix([4, 5]).last_node
    cache.lock(node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.size_info() == (0, 0, 0) and cache.match_prefix([1, 2]).slots.numel() == 0
    allocator.check_integrity(held=0)
    cache.check_integrity()


def test_no_prefix_cache_frees_what_it_is_given():
    allocator = SlotAllocator(9)
    cache = NoPrefixCache(allocator)
    assert cache.insert([1, 2, 3], allocator.alloc(3)) == 0
    allocator.check_integrity(held=0)
    match = cache.match_prefix([1, 2, 3])
    assert match.slots.numel() == 0 and match.last_node is cache.root
    cache.lock(match.last_node)
    assert cache.evict(10) == 0 and cache.size_info() == (0, 0, 0)
    assert cache.evictable_tokens == 0
    assert cache.order_by_tree([None, None, None]) == [0, 1, 2]


def test_order_by_tree_groups_siblings_heaviest_first():
    cache, allocator = make_cache()
    for ids in ([1, 1, 2], [1, 1, 3], [5]):
        insert_new(cache, allocator, ids)
    prompts = [[5, 0], [1, 1, 2, 0], [1, 1, 3], [1, 1, 2], [7], [1, 1, 8]]
    last_nodes = [cache.match_prefix(ids).last_node for ids in prompts]
    # root: request 4; then [1, 1] (weight 4: request 5 sits on it), whose heavier child
    # [2] (requests 1, 3) goes before [3] (request 2); then [5] (request 0).
    assert cache.order_by_tree(last_nodes) == [4, 5, 1, 3, 2, 0]
    assert cache.order_by_tree([]) == []


def test_match_of_a_long_prompt_among_many_finds_the_shared_part():
    cache, allocator = make_cache(capacity=100 * 2000)
    system = list(range(1000))
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        tail = torch.randint(0, 30000, (1000,), generator=generator).tolist()
        insert_new(cache, allocator, system + tail)
    prompt = system + tail[:500] + list(range(500))
    match = cache.match_prefix(prompt)
    assert match.slots.numel() == 1500


# ---- state machine against a reference model -----------------------------------------------

ALPHABET = st.integers(0, 2)  # small, so prompts share prefixes
IDS = st.lists(ALPHABET, min_size=1, max_size=8)
CAPACITY = 40


class RadixMachine(RuleBasedStateMachine):
    """The reference is the set of cached prefixes, each mapped to the slot of its last
    token. It stays prefix-closed: eviction removes whole suffixes, so after `evict` the
    reference drops exactly the prefixes whose slots the pool got back, and the checks
    are that what is left is still prefix-closed, holds every locked prefix, and that
    enough was freed."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = SlotAllocator(CAPACITY + 1)
        self.pool = RecordingPool(self.allocator)
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple[int, ...], int] = {}
        self.stamps: dict[tuple[int, ...], int] = {}  # prefix -> last op that reached it
        self.clock = 0
        self.locks: list[tuple[object, tuple[int, ...]]] = []  # (node, locked prefix)
        self.requests: list[tuple[object, list[int], torch.Tensor, torch.Tensor]] = []

    # reference helpers

    def expected_match(self, ids: list[int]) -> list[int]:
        slots = []
        for end in range(1, len(ids) + 1):
            if tuple(ids[:end]) not in self.model:
                break
            slots.append(self.model[tuple(ids[:end])])
        return slots

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        held = [prefix for _, prefix in self.locks]
        held += [tuple(ids[: len(prefix)]) for _, ids, prefix, _ in self.requests]
        return {p[:end] for p in held for end in range(1, len(p) + 1)}

    def held_by_test(self) -> int:
        return sum(own.numel() for *_, own in self.requests)

    def touch(self, ids: list[int], length: int) -> None:
        self.clock += 1
        for end in range(1, length + 1):
            self.stamps[tuple(ids[:end])] = self.clock

    def match_and_check(self, ids: list[int]):
        match = self.cache.match_prefix(ids)
        assert match.slots.tolist() == self.expected_match(ids)
        self.touch(ids, match.slots.numel())
        return match

    def store(self, ids: list[int], slots: torch.Tensor, cached: int) -> None:
        assert cached == len(self.expected_match(ids))
        for end in range(cached + 1, len(ids) + 1):
            self.model[tuple(ids[:end])] = int(slots[end - 1])
        self.touch(ids, len(ids))

    def check_lru(self, removed: set[tuple[int, ...]]) -> None:
        """Nothing evicted was used more recently than an unlocked leaf left behind."""
        parents = {p[:-1] for p in self.model}
        locked = self.locked_prefixes()
        leaves = [p for p in self.model if p not in parents and p not in locked]
        if removed and leaves:
            newest_removed = max(self.stamps[p] for p in removed)
            assert newest_removed <= min(self.stamps[p] for p in leaves), "not LRU"

    def evict_and_check(self, num_tokens: int) -> int:
        evictable = len(self.model) - len(self.locked_prefixes())
        self.pool.freed.clear()
        freed = self.cache.evict(num_tokens)
        gone = set(self.pool.freed)
        assert freed == len(gone) == len(self.pool.freed)
        assert freed >= min(num_tokens, evictable)
        removed = {p for p, slot in self.model.items() if slot in gone}
        assert len(removed) == freed, "evict freed a slot the cache did not hold"
        assert not removed & self.locked_prefixes(), "a locked prefix was evicted"
        for prefix in removed:
            del self.model[prefix]
        assert all(len(p) == 1 or p[:-1] in self.model for p in self.model), "not a suffix"
        self.check_lru(removed)
        if freed < num_tokens:
            assert set(self.model) == self.locked_prefixes(), "evictable tokens left"
        return freed

    def make_room(self, n: int) -> bool:
        if self.allocator.num_free < n:
            self.evict_and_check(n - self.allocator.num_free)
        return self.allocator.num_free >= n

    # rules

    @rule(ids=IDS)
    def insert(self, ids):
        if not self.make_room(len(ids)):
            return
        slots = self.allocator.alloc(len(ids))
        cached = self.cache.insert(ids, slots)
        self.allocator.free(slots[:cached])
        self.store(ids, slots, cached)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tail=st.lists(ALPHABET, max_size=4))
    def insert_extension(self, data, tail):
        """Inserts a cached prefix cut anywhere plus a tail: splits edges mid-way."""
        prefix = data.draw(st.sampled_from(sorted(self.model)))
        self.insert(list(prefix) + tail)

    @rule(ids=IDS)
    def match(self, ids):
        self.match_and_check(ids)

    @rule(ids=IDS)
    def lock(self, ids):
        match = self.match_and_check(ids)
        self.cache.lock(match.last_node)
        self.locks.append((match.last_node, tuple(ids[: match.slots.numel()])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        index = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(index)
        self.cache.unlock(node)

    @rule(ids=IDS)
    def start_request(self, ids):
        """Like the scheduler: match, lock, allocate the rest and hold it."""
        match = self.match_and_check(ids)
        self.cache.lock(match.last_node)
        need = len(ids) - match.slots.numel()
        self.locks.append((match.last_node, tuple(ids[: match.slots.numel()])))
        room = self.make_room(need)
        self.locks.pop()
        if not room:
            self.cache.unlock(match.last_node)
            return
        self.requests.append((match.last_node, ids, match.slots, self.allocator.alloc(need)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        index = data.draw(st.integers(0, len(self.requests) - 1))
        node, ids, prefix, own = self.requests.pop(index)
        slots = torch.cat([prefix, own])
        cached = self.cache.insert(ids, slots)
        assert cached >= prefix.numel()
        self.allocator.free(slots[prefix.numel() : cached])
        self.store(ids, slots, cached)
        self.cache.unlock(node)

    @rule(num_tokens=st.integers(0, 30))
    def evict(self, num_tokens):
        self.evict_and_check(num_tokens)

    @precondition(lambda self: not self.locks and not self.requests)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model.clear()

    @rule(prompts=st.lists(IDS, min_size=1, max_size=6))
    def order_by_tree(self, prompts):
        nodes = [self.match_and_check(ids).last_node for ids in prompts]
        check_tree_order(nodes, self.cache.order_by_tree(nodes))

    # invariants

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        info = self.cache.size_info()
        locked = len(self.locked_prefixes())
        assert info == (len(self.model), len(self.model) - locked, locked)
        assert self.cache.evictable_tokens == info.evictable_tokens
        self.allocator.check_integrity(held=len(self.model) + self.held_by_test())


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixMachine = RadixMachine.TestCase
