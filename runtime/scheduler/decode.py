"""Decode: one new token per decoding request per step, retraction when memory runs out."""

from __future__ import annotations

from spruce.runtime.core.request import Req
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.output import ScheduleOutput


class DecodeManager:
    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache

    def schedule(
        self, out: ScheduleOutput, decoding: list[Req], running: list[Req],
        drafts: dict[int, list[int]] | None = None, steps: int = 1,
    ) -> list[Req]:  # fmt: skip
        """Adds every decoding request with one new slot, plus one per drafted token
        (`drafts`: {id(req): draft}), or with `steps` slots for as many greedy decode
        steps. When the pool (after eviction) cannot give that, the drafts or the further
        steps go first, then the most recently admitted running requests are retracted
        until it can; returns the retracted requests."""
        retracted: list[Req] = []
        candidates = sorted(running, key=lambda r: r.admit_order)
        drafts = drafts or {}
        while decoding:
            counts = [steps + len(drafts.get(id(req), ())) for req in decoding]
            slots = self.cache.alloc(sum(counts))
            if slots is not None:
                parts = slots.split(counts) if len(counts) > 1 else (slots,)
                for req, n, slot in zip(decoding, counts, parts):
                    out.add(req, n, slot, drafts.get(id(req)), steps)
                return retracted
            if drafts or steps > 1:
                drafts, steps = {}, 1
                continue
            victim = candidates.pop()
            retracted.append(victim)
            if victim in decoding:
                decoding.remove(victim)
            elif (slots := out.remove(victim)) is not None:
                self.cache.free_slots(slots)
        return retracted
