"""A regex as a byte-level NFA: what the token masks are computed from (see byte_dfa.py).

The regex is parsed by Python's own parser (`re._parser`, so the syntax is exactly what the
regex-level checks accept) and built Thompson-style over UTF-8 bytes: a character class
becomes the byte-range sequences of its code points' UTF-8 forms (surrogates excluded),
with sequences that end alike sharing their final states. Bounded repeats are multiplied
out, so the NFA grows linearly with the regex's expanded size; MAX_STATES caps it.

`\\d` is [0-9] (as JSON Schema's ECMA-262 patterns mean it); `\\w` and `\\s` are Python's
Unicode classes (the regex-level checks use Python's `re`); `.` is any character but a
newline. Anchors, backreferences, lookaround and flags are refused (the schema converter
removes the anchors it understands before a regex gets here).

The NFA is plain lists of ints, so it crosses the build worker's pipe cheaply."""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from functools import lru_cache

from spruce.constrained.errors import ConstraintError

try:  # Python 3.11+
    from re import _constants as sre, _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_STATES = 1_500_000  # ~150 MB of lists; a 32k-position JSON schema regex needs ~200k
MAX_CODE_POINT = sys.maxunicode
_SURROGATES = (0xD800, 0xDFFF)
_UTF8_LIMITS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)


class ByteNFA:
    """States 0..n-1; `eps[s]`: epsilon targets; `edges[s]`: (low byte, high byte, target)
    triples; one start and one final state. Only states that can reach the final state
    are kept reachable (edges into dead states are dropped)."""

    __slots__ = ("eps", "edges", "start", "final")

    def __init__(self, eps: list[list[int]], edges: list[list[tuple[int, int, int]]], start: int, final: int):
        self.eps, self.edges, self.start, self.final = eps, edges, start, final

    @property
    def num_states(self) -> int:
        return len(self.eps)

    def __getstate__(self):
        return self.eps, self.edges, self.start, self.final

    def __setstate__(self, state) -> None:
        self.eps, self.edges, self.start, self.final = state


# Python's regex parser (and the builder below) recurse once or twice per nested group; a
# schema's optional properties nest one group each, so a few hundred of them pass Python's
# default limit of 1000 frames. Python-to-Python calls do not grow the C stack (3.11+), so
# a higher limit is safe while parsing.
PARSE_RECURSION_LIMIT = 50_000


@contextmanager
def deep_recursion():
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, PARSE_RECURSION_LIMIT))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def parse_regex(regex: str):
    """Python's parse tree of `regex`; ConstraintError for invalid syntax or a feature the
    NFA does not support (anchors, backreferences, lookaround, flags, conditionals)."""
    with deep_recursion():
        try:
            tree = sre_parse.parse(regex)
        except re.error as e:
            raise ConstraintError(f"invalid regex {_short(regex)}: {e}") from None
        if tree.state.flags & ~(re.UNICODE | re.VERBOSE) & 0xFF:
            raise ConstraintError(f"unsupported regex feature in {_short(regex)}: inline flags")
        _check(tree, regex)
    return tree


def build_nfa(regex: str, max_states: int = MAX_STATES) -> ByteNFA:
    """ConstraintError as parse_regex, for a regex matching nothing, or past `max_states`."""
    tree = parse_regex(regex)
    builder = _Builder(regex, max_states)
    with deep_recursion():
        start, end = builder.sequence(tree)
    nfa = ByteNFA(builder.eps, builder.edges, start, end)
    _prune(nfa)
    if not nfa.eps[start] and not nfa.edges[start] and start != end:
        raise ConstraintError(f"the regex {_short(regex)} matches no string")
    return nfa


_ATOMS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY)
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", sre.MAX_REPEAT))


def _check(items, regex: str) -> None:
    for op, arg in items:
        if op in _ATOMS:
            continue
        if op is sre.IN:
            _class_ranges(arg, regex)
        elif op is sre.SUBPATTERN:
            if arg[1] & ~re.UNICODE or arg[2]:
                raise ConstraintError(f"unsupported regex feature in {_short(regex)}: inline flags")
            _check(arg[3], regex)
        elif op is sre.BRANCH:
            for branch in arg[1]:
                _check(branch, regex)
        elif op in _REPEATS:
            _check(arg[2], regex)
        elif op is getattr(sre, "ATOMIC_GROUP", None):
            _check(arg, regex)
        else:
            what = "lookaround" if op in (sre.ASSERT, sre.ASSERT_NOT) else str(op).lower()
            raise ConstraintError(f"unsupported regex feature in {_short(regex)}: {what}")


class _Builder:
    def __init__(self, regex: str, max_states: int) -> None:
        self.regex, self.max_states = regex, max_states
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def state(self) -> int:
        if len(self.eps) >= self.max_states:
            raise ConstraintError(
                f"constraint too large: the regex {_short(self.regex)} needs more than {self.max_states} "
                "automaton states; lower the bounded repeats (maxLength, maxItems, {m,n})"
            )
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def sequence(self, items) -> tuple[int, int]:
        start = end = self.state()
        for op, arg in items:
            first, last = self.item(op, arg)
            self.eps[end].append(first)
            end = last
        return start, end

    def item(self, op, arg) -> tuple[int, int]:
        if op is sre.LITERAL:
            return self.chars(((arg, arg),))
        if op is sre.NOT_LITERAL:
            return self.chars(_complement(((arg, arg),)))
        if op is sre.ANY:
            return self.chars(_complement(((10, 10),)))
        if op is sre.IN:
            return self.chars(_class_ranges(arg, self.regex))
        if op is sre.SUBPATTERN:  # (flags checked by parse_regex)
            return self.sequence(arg[3])
        if op is sre.BRANCH:
            start, end = self.state(), self.state()
            for items in arg[1]:
                first, last = self.sequence(items)
                self.eps[start].append(first)
                self.eps[last].append(end)
            return start, end
        if op in _REPEATS:
            low, high, items = arg
            return self.repeat(items, low, None if high is sre.MAXREPEAT else high)
        if op is getattr(sre, "ATOMIC_GROUP", None):
            return self.sequence(arg)
        raise AssertionError(f"unchecked regex op {op}")  # parse_regex refuses it first

    def repeat(self, items, low: int, high: int | None) -> tuple[int, int]:
        start = end = self.state()
        for _ in range(low):
            first, last = self.sequence(items)
            self.eps[end].append(first)
            end = last
        if high is None:  # a loop: end -> body -> end, and out
            first, last = self.sequence(items)
            self.eps[end].append(first)
            self.eps[last].append(end)
            return start, end
        exit_ = self.state()
        for _ in range(high - low):  # nested optionals: each may stop
            self.eps[end].append(exit_)
            first, last = self.sequence(items)
            self.eps[end].append(first)
            end = last
        self.eps[end].append(exit_)
        return start, exit_

    def chars(self, ranges) -> tuple[int, int]:
        """A fragment matching one character of `ranges` (code point pairs) in UTF-8."""
        start, end = self.state(), self.state()
        suffix_states: dict[tuple, int] = {(): end}
        for seq in _utf8_sequences(tuple(ranges)):
            target = end
            for k in range(len(seq) - 1, 0, -1):  # share the states of common suffixes
                suffix = seq[k:]
                state = suffix_states.get(suffix)
                if state is None:
                    state = suffix_states[suffix] = self.state()
                    low, high = seq[k]
                    self.edges[state].append((low, high, target))
                target = state
            low, high = seq[0]
            self.edges[start].append((low, high, target))
        return start, end


def _prune(nfa: ByteNFA) -> None:
    """Drops the edges into states that cannot reach the final state."""
    reverse: list[list[int]] = [[] for _ in nfa.eps]
    for src in range(len(nfa.eps)):
        for dst in nfa.eps[src]:
            reverse[dst].append(src)
        for _low, _high, dst in nfa.edges[src]:
            reverse[dst].append(src)
    live = bytearray(len(nfa.eps))
    live[nfa.final] = 1
    stack = [nfa.final]
    while stack:
        for src in reverse[stack.pop()]:
            if not live[src]:
                live[src] = 1
                stack.append(src)
    for s in range(len(nfa.eps)):
        if not live[s]:
            nfa.eps[s], nfa.edges[s] = [], []
            continue
        if any(not live[d] for d in nfa.eps[s]):
            nfa.eps[s] = [d for d in nfa.eps[s] if live[d]]
        if any(not live[d] for _, _, d in nfa.edges[s]):
            nfa.edges[s] = [e for e in nfa.edges[s] if live[e[2]]]


# -- character classes -------------------------------------------------------------------------


def _class_ranges(items, regex: str) -> tuple[tuple[int, int], ...]:
    negate, ranges = False, []
    for op, arg in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            ranges.append((arg, arg))
        elif op is sre.RANGE:
            ranges.append(arg)
        elif op is sre.CATEGORY:
            ranges.extend(_category(arg))
        else:
            raise ConstraintError(f"unsupported regex feature in {_short(regex)}: {str(op).lower()} in a class")
    merged = _merge(ranges)
    return _complement(merged) if negate else merged


def _category(category) -> tuple[tuple[int, int], ...]:
    name = str(category).upper()
    negated = "NOT_" in name
    if "DIGIT" in name:
        ranges = ((ord("0"), ord("9")),)
    elif "WORD" in name:
        ranges = _unicode_class("word")
    elif "SPACE" in name:
        ranges = _unicode_class("space")
    else:  # pragma: no cover - line breaks: not produced by the parser inside classes
        raise ConstraintError(f"unsupported regex class {name}")
    return _complement(ranges) if negated else ranges


@lru_cache(maxsize=None)
def _unicode_class(kind: str) -> tuple[tuple[int, int], ...]:
    """Python `re`'s \\w (alphanumeric or '_') or \\s (str.isspace) as code point ranges."""
    test = (lambda c: c.isalnum() or c == "_") if kind == "word" else str.isspace
    ranges, start = [], None
    for code in range(MAX_CODE_POINT + 2):
        inside = code <= MAX_CODE_POINT and test(chr(code))
        if inside and start is None:
            start = code
        elif not inside and start is not None:
            ranges.append((start, code - 1))
            start = None
    return tuple(ranges)


def _merge(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], high)
        else:
            out.append([low, high])
    return tuple((low, high) for low, high in out)


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for low, high in _merge(ranges):
        if low > nxt:
            out.append((nxt, low - 1))
        nxt = high + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return tuple(out)


@lru_cache(maxsize=4096)
def _utf8_sequences(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The code point ranges as sequences of byte ranges, one byte range per UTF-8 byte."""
    out: list[tuple[tuple[int, int], ...]] = []
    for low, high in ranges:
        for a, b in _without_surrogates(low, high):
            for limit_low, limit_high in zip((0,) + tuple(x + 1 for x in _UTF8_LIMITS[:-1]), _UTF8_LIMITS):
                lo, hi = max(a, limit_low), min(b, limit_high)
                if lo <= hi:
                    _split(lo, hi, out)
    return tuple(out)


def _without_surrogates(low: int, high: int) -> list[tuple[int, int]]:
    s_low, s_high = _SURROGATES
    if high < s_low or low > s_high:
        return [(low, high)]
    parts = []
    if low < s_low:
        parts.append((low, s_low - 1))
    if high > s_high:
        parts.append((s_high + 1, high))
    return parts


def _split(low: int, high: int, out: list) -> None:
    """Appends the byte-range sequences of [low, high] (same UTF-8 length): split until
    every byte varies independently over its range."""
    width = len(chr(low).encode())
    for i in range(1, width):
        mask = (1 << (6 * i)) - 1
        if low & ~mask != high & ~mask:
            if low & mask:
                _split(low, low | mask, out)
                _split((low | mask) + 1, high, out)
                return
            if high & mask != mask:
                _split(low, (high & ~mask) - 1, out)
                _split(high & ~mask, high, out)
                return
    a, b = chr(low).encode(), chr(high).encode()
    out.append(tuple(zip(a, b)))


def _short(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")
