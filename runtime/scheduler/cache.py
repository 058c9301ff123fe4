"""The KV resources of requests: table rows, slots and the prefix cache, kept consistent.

Invariant: a request's row holds the slots of its first `computed_len` tokens (the model
runner writes the slots of each step's new tokens when it runs them). The first `cache_owned_len` of them
belong to the prefix cache (matched or inserted, kept alive by the lock on `last_node`);
the rest belong to the request until it inserts them into the cache or frees them.
"""

from __future__ import annotations

import torch

from spruce.radix import NoPrefixCache, PrefixCache
from spruce.runtime.core.request import Req
from spruce.runtime.executor.kv_pool import ReqToTokenTable, SlotAllocator


class CacheManager:
    def __init__(
        self, allocator: SlotAllocator, table: ReqToTokenTable, cache: PrefixCache
    ) -> None:
        self.allocator = allocator
        self.table = table
        self.prefix_cache = cache
        self.shares_prefixes = not isinstance(cache, NoPrefixCache)
        # cumulative, counted at each request's first admission
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0

    @property
    def available(self) -> int:
        """Slots that can be had now: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.prefix_cache.evictable_tokens

    def alloc(self, n: int) -> torch.Tensor | None:
        """n slots, evicting cached tokens when needed; None if they cannot be had."""
        shortfall = n - self.allocator.num_free
        if shortfall > 0 and self.prefix_cache.evict(shortfall) < shortfall:
            return None
        return self.allocator.alloc(n)

    def admit(self, req: Req) -> None:
        """Gives the request a row and reuses the longest cached prefix of its tokens.

        At least one token is left to compute (its logits are needed), and prompt
        positions whose logprobs are wanted are recomputed, as are all positions of an
        embedding request pooled over them (mean) or over its first (cls)."""
        req.row = self.table.alloc_row()
        limit = req.total_len - 1
        start = req.prompt_logprob_start
        if start is not None:
            limit = min(limit, max(start - 1, 0))
        if req.pooling in ("mean", "cls"):
            limit = 0
        match = self.prefix_cache.match_prefix(req.token_ids(0, limit))
        self.prefix_cache.lock(match.last_node)
        self.table.write(req.row, 0, match.slots)
        req.last_node = match.last_node
        req.computed_len = req.cache_owned_len = match.slots.numel()

    def count_admission(self, req: Req) -> None:
        """Records the prompt's cache hit at the request's first (kept) admission."""
        if req.cached_tokens is None:
            req.cached_tokens = min(req.computed_len, len(req.prompt_ids))
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_prompt_tokens += req.cached_tokens

    def cache_partial(self, req: Req) -> None:
        """Inserts what a running request has computed so far, so that others can share it
        while it continues; its row then points at the cache's slots."""
        if not self.shares_prefixes or req.computed_len <= req.cache_owned_len:
            return
        ids = req.token_ids(0, req.computed_len)
        self._insert(req, ids)
        match = self.prefix_cache.match_prefix(ids)
        assert match.slots.numel() == len(ids), "just-inserted tokens must match"
        self.table.write(req.row, 0, match.slots)
        self.prefix_cache.lock(match.last_node)
        self.prefix_cache.unlock(req.last_node)
        req.last_node = match.last_node
        req.cache_owned_len = len(ids)

    def rollback(self, req: Req, keep_len: int) -> None:
        """Forgets computed tokens after `keep_len` (jump-forward re-tokenized them); with a
        prefix cache their K/V stay cached, otherwise their slots are freed."""
        if keep_len >= req.computed_len:
            return
        if self.shares_prefixes:
            self.cache_partial(req)
        else:
            self.allocator.free(self.table.read(req.row, req.computed_len, keep_len))
        req.computed_len = keep_len
        req.cache_owned_len = min(req.cache_owned_len, keep_len)

    def release(self, req: Req) -> None:
        """A finished, aborted or retracted request: its computed tokens go into the cache
        (duplicates freed), its lock and row are given back."""
        if req.row is None:
            return
        slots = self.table.read(req.row, req.computed_len)
        self._insert(req, req.token_ids(0, req.computed_len), slots)
        self.prefix_cache.unlock(req.last_node)
        self.table.free_row(req.row)
        req.row, req.last_node = None, None
        req.cache_owned_len = 0

    def free_slots(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def undo_step(self, req: Req, slots: torch.Tensor) -> None:
        """A step that failed before `update()`: the slots `schedule()` gave the request go
        back, and the row positions the model runner pointed at them are reset to the padding
        slot, so no row refers to a free slot. `computed_len` was never advanced."""
        self.allocator.free(slots)
        self.table.write(req.row, req.computed_len, torch.zeros_like(slots))

    def _insert(self, req: Req, ids: list[int], slots: torch.Tensor | None = None) -> None:
        if slots is None:
            slots = self.table.read(req.row, len(ids))
        already = self.prefix_cache.insert(ids, slots)
        # Slots between what the request got from the cache and what the cache already had
        # were computed twice: the cache keeps its own, the request's copies go back.
        if already > req.cache_owned_len:
            self.allocator.free(slots[req.cache_owned_len : already])

    def held_slots(self, running: list[Req]) -> int:
        """Slots owned by running requests (for integrity checks)."""
        return sum(r.computed_len - r.cache_owned_len for r in running if r.row is not None)

    def check_integrity(self, running: list[Req]) -> None:
        """Debug check of the pool accounting (tests call it after failures): used slots ==
        slots referenced by the prefix cache + those owned by running requests."""
        self.prefix_cache.check_integrity()
        cached = self.prefix_cache.size_info().cached_tokens
        self.allocator.check_integrity(held=cached + self.held_slots(running))
