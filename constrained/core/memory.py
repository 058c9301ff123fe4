"""Bounds on what requests make: an LRU cache bounded in bytes (for caches keyed by request
data, whose entries can be megabytes: a regex of one 200k-character class), a grammar's
byte budget (its NFA, the DFA rows and token masks requests add as they walk), and the
error for a token mask whose walk would make too many new DFA states (token_trie.py).

Sizes are estimates from the shapes of what is stored (lengths times measured per-item
costs), cheap to compute; they are meant to be within a small factor of the real bytes."""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

from spruce.constrained.core.errors import ConstraintError

# Measured (tracemalloc, CPython 3.11): a tuple of two or three ints in a tuple or list,
# the ints mostly past the small-int cache, costs about this much per element.
PAIR_BYTES = 110
EDGE_BYTES = 130


class BoundedCache:
    """Least recently used entries, at most `max_bytes` in all (by the size each `put`
    names); an entry larger than `max_bytes // 4` is not kept. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, default: object = None) -> object:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return default
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: object, nbytes: int) -> None:
        if nbytes > self.max_bytes // 4:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.nbytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


_MISSING = object()


def bounded_cache(max_bytes: int, size: Callable[[tuple, object], int]):
    """Decorator: memoizes a function of hashable arguments in a BoundedCache, `size(args,
    result)` being an entry's bytes. The wrapper has `cache` and `cache_clear()`."""

    def wrap(function):
        cache = BoundedCache(max_bytes)

        @functools.wraps(function)
        def cached(*args):
            value = cache.get(args, _MISSING)
            if value is _MISSING:
                value = function(*args)
                cache.put(args, value, size(args, value))
            return value

        cached.cache = cache
        cached.cache_clear = cache.clear
        return cached

    return wrap


def text_bytes(text: str) -> int:
    return sys.getsizeof(text)


class GrammarTooLarge(ConstraintError):
    """A grammar's automaton or masks outgrew its byte budget as a request walked it."""


class MemoryBudget:
    """What one grammar holds, in bytes, against its cap: `charge` adds (thread-safe) and
    raises GrammarTooLarge, without adding, when the total would pass `max_bytes`; after
    that `exhausted` is set (the compiler drops such a grammar from its cache).

    `shared`, when given, is the budget of every live grammar together: each charge is
    charged there too, and `release()` (when the grammar is collected) gives it back."""

    def __init__(self, max_bytes: int, shared: SharedBudget | None = None) -> None:
        self.max_bytes = max_bytes
        self.shared = shared
        self.used = 0
        self.exhausted = False
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> None:
        with self._lock:
            if self.used + nbytes > self.max_bytes:
                self.exhausted = True
                raise GrammarTooLarge(
                    f"the constraint's automaton needs more than its memory budget of "
                    f"{self.max_bytes / 2**20:.1f} MB (its NFA, and the DFA states and token masks "
                    "outputs walk into); simplify the constraint (fewer ambiguous repeats such as "
                    "'.*a.{24}'), or raise --grammar-cache-mb (a grammar may hold a quarter of it)"
                )
            if self.shared is not None:
                self.shared.charge(nbytes)
            self.used += nbytes

    def release(self) -> None:
        with self._lock:
            if self.shared is not None:
                self.shared.release(self.used)
            self.used = 0


class Budgeted:
    """A compiled grammar's memory (every backend's): what it holds is charged to its own
    MemoryBudget of `max_bytes` (and to `shared`, the compiler's budget for all live
    grammars), given back when the grammar is collected."""

    def __init__(self, max_bytes: int, shared: SharedBudget | None = None) -> None:
        self.budget = MemoryBudget(max_bytes, shared)
        weakref.finalize(self, self.budget.release)

    @property
    def nbytes(self) -> int:
        """What it holds now (the compiler's cache counts it)."""
        return self.budget.used

    @property
    def exhausted(self) -> bool:
        """A charge was refused for passing the budget (the cache drops this grammar)."""
        return self.budget.exhausted


class SharedBudget:
    """The bytes every live grammar of a compiler holds together (cached or only held by
    requests), against `max_bytes`: past it, the walk that would grow one is refused."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int) -> None:
        with self._lock:
            if self.used + nbytes > self.max_bytes:
                raise GrammarTooLarge(
                    f"the constraints in use hold {self.used / 2**20:.1f} MB, their memory budget "
                    f"is {self.max_bytes / 2**20:.1f} MB (twice --grammar-cache-mb); retry later or "
                    "simplify the constraint"
                )
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class MaskTooExpensive(ConstraintError):
    """A token mask whose trie walk would make more new DFA states than its budget allows."""

    def __init__(self) -> None:
        super().__init__(
            "the constraint is too costly to follow: one token mask needed more new automaton "
            "states than a mask may make; simplify the constraint (fewer ambiguous repeats "
            "such as '.*a.{24}')"
        )
