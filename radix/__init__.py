"""Radix-tree prefix cache: token ids -> KV slot indices, shared between requests."""

from spruce.radix.base import MatchResult, PrefixCache, SizeInfo, SlotPool
from spruce.radix.no_cache import NoPrefixCache
from spruce.radix.radix_cache import RadixCache, RadixNode

__all__ = [
    "MatchResult",
    "NoPrefixCache",
    "PrefixCache",
    "RadixCache",
    "RadixNode",
    "SizeInfo",
    "SlotPool",
]
