"""Decode: one new token per decoding request per step, retraction when memory runs out."""

from __future__ import annotations

from spruce.runtime.core.request import Req
from spruce.runtime.scheduler.cache import CacheManager
from spruce.runtime.scheduler.output import ScheduleOutput


class DecodeManager:
    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache

    def schedule(self, out: ScheduleOutput, decoding: list[Req], running: list[Req]) -> list[Req]:
        """Adds every decoding request with one new slot. When the pool (after eviction)
        cannot give a slot to each, the most recently admitted running requests are
        retracted until it can; returns the retracted requests."""
        retracted: list[Req] = []
        candidates = sorted(running, key=lambda r: r.admit_order)
        while decoding:
            slots = self.cache.alloc(len(decoding))
            if slots is not None:
                for req, slot in zip(decoding, slots.split(1)):
                    out.add(req, 1, slot)
                return retracted
            victim = candidates.pop()
            retracted.append(victim)
            if victim in decoding:
                decoding.remove(victim)
            elif (slots := out.remove(victim)) is not None:
                self.cache.free_slots(slots)
        return retracted
