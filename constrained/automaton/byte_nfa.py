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

The NFA is rows of ints, so it crosses the build worker's pipe as a few byte strings."""

from __future__ import annotations

import re
import sys
from array import array
from contextlib import contextmanager
from functools import cache

from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.memory import EDGE_BYTES, PAIR_BYTES, bounded_cache

try:  # Python 3.11+
    from re import _constants as sre  # type: ignore[attr-defined]
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - older Pythons
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_STATES = 1_500_000  # ~150 MB of lists; a 32k-position JSON schema regex needs ~200k
MAX_CODE_POINT = sys.maxunicode
_SURROGATES = (0xD800, 0xDFFF)
_UTF8_LIMITS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)
# Each class cache (shared by every request of the process) holds at most this; a class
# too large for a quarter of it is recomputed per build (once: the builder keeps its own).
CLASS_CACHE_BYTES = 8 * 2**20


class ByteNFA:
    """States 0..n-1 in compressed rows: state s's epsilon targets are
    `eps_to[eps_at[s]:eps_at[s + 1]]`, its byte edges `edge_low / edge_high / edge_to` over
    `edge_at[s]:edge_at[s + 1]` (inclusive byte ranges); one start and one final state. Every
    state with an edge can reach the final state. Crosses the worker's pipe as int arrays."""

    __slots__ = (
        "start",
        "final",
        "eps_at",
        "eps_to",
        "edge_at",
        "edge_low",
        "edge_high",
        "edge_to",
    )
    _ROWS = ("eps_at", "eps_to", "edge_at", "edge_low", "edge_high", "edge_to")

    def __init__(
        self, eps: list[list[int]], edges: list[list[tuple[int, int, int]]], start: int, final: int
    ):
        self.start, self.final = start, final
        self.eps_at, self.eps_to = _compressed(eps)
        self.edge_at, flat = _compressed(edges)
        self.edge_low = [e[0] for e in flat]
        self.edge_high = [e[1] for e in flat]
        self.edge_to = [e[2] for e in flat]

    @property
    def num_states(self) -> int:
        return len(self.eps_at) - 1

    @property
    def nbytes(self) -> int:
        """Memory of the rows (list slots, and an int object for each value past 256)."""
        big = len(self.eps_at) + len(self.eps_to) + len(self.edge_at) + len(self.edge_to)
        return 36 * big + 8 * (len(self.edge_low) + len(self.edge_high))

    def __getstate__(self):
        return (
            self.start,
            self.final,
            *(array("i", getattr(self, name)).tobytes() for name in self._ROWS),
        )

    def __setstate__(self, state) -> None:
        self.start, self.final, *rows = state
        for name, data in zip(self._ROWS, rows):
            values = array("i")
            values.frombytes(data)
            setattr(self, name, values.tolist())


def _compressed(rows: list[list]) -> tuple[list[int], list]:
    at, flat = [0], []
    for row in rows:
        flat.extend(row)
        at.append(len(flat))
    return at, flat


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
    start = builder.states(1)
    with deep_recursion():
        end = builder.sequence(tree, start)
    if builder.dead_ends:  # an empty class: drop what cannot reach the end
        _prune(builder.eps, builder.edges, end)
        if not builder.eps[start] and not builder.edges[start] and start != end:
            raise ConstraintError(f"the regex {_short(regex)} matches no string")
    return ByteNFA(builder.eps, builder.edges, start, end)


_ATOMS = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY)
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT)  # possessive repeats and atomic groups are refused:
# they change which strings a backtracking engine matches


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
        else:
            what = "lookaround" if op in (sre.ASSERT, sre.ASSERT_NOT) else str(op).lower()
            raise ConstraintError(f"unsupported regex feature in {_short(regex)}: {what}")


class _Builder:
    """Thompson's construction, each fragment built onward from the state it starts at (so a
    literal costs one state). Only a loop's own fresh state receives a back edge, so a state
    shared by a branch's alternatives never loops into another alternative."""

    def __init__(self, regex: str, max_states: int) -> None:
        self.regex, self.max_states = regex, max_states
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []
        self.dead_ends = False  # some class matched no character
        self.templates: dict[int, tuple] = {}  # id of a class in the parse tree -> its template

    def states(self, count: int) -> int:
        """The first of `count` new states."""
        first = len(self.eps)
        if first + count > self.max_states:
            raise ConstraintError(
                f"constraint too large: the regex {_short(self.regex)} needs more than {self.max_states} "
                "automaton states; lower the bounded repeats (maxLength, maxItems, {m,n})"
            )
        self.eps.extend([] for _ in range(count))
        self.edges.extend([] for _ in range(count))
        return first

    def sequence(self, items, state: int) -> int:
        """Builds `items` onward from `state`; the state they end in."""
        for op, arg in items:
            state = self.item(op, arg, state)
        return state

    def item(self, op, arg, state: int) -> int:
        if op is sre.LITERAL:
            return self.chars(((arg, arg),), state)
        if op is sre.NOT_LITERAL:
            return self.chars(_complement(((arg, arg),)), state)
        if op is sre.ANY:
            return self.chars(_complement(((10, 10),)), state)
        if op is sre.IN:
            return self.place(self.class_template(arg), state)
        if op is sre.SUBPATTERN:  # (flags checked by parse_regex)
            return self.sequence(arg[3], state)
        if op is sre.BRANCH:
            end = self.states(1)
            for items in arg[1]:
                self.eps[self.sequence(items, state)].append(end)
            return end
        if op in _REPEATS:
            low, high, items = arg
            return self.repeat(items, low, None if high is sre.MAXREPEAT else high, state)
        raise AssertionError(f"unchecked regex op {op}")  # parse_regex refuses it first

    def repeat(self, items, low: int, high: int | None, state: int) -> int:
        for _ in range(low):
            state = self.sequence(items, state)
        if high is None:  # a loop on a fresh state: body and back, or on
            loop = self.states(1)
            self.eps[state].append(loop)
            self.eps[self.sequence(items, loop)].append(loop)
            return loop
        if high == low:
            return state
        exit_ = self.states(1)
        for _ in range(high - low):  # nested optionals: each may stop
            self.eps[state].append(exit_)
            state = self.sequence(items, state)
        self.eps[state].append(exit_)
        return exit_

    def class_template(self, items) -> tuple:
        """The template of a class of the parse tree, made once per build however often a
        repeat copies it (the shared caches may not keep a giant one)."""
        template = self.templates.get(id(items))
        if template is None:
            template = self.templates[id(items)] = _class_template(_class_ranges(items, self.regex))
        return template

    def chars(self, ranges, state: int) -> int:
        """One character of `ranges` (code point pairs) in UTF-8, onward from `state`."""
        return self.place(_class_template(tuple(ranges)), state)

    def place(self, template: tuple, state: int) -> int:
        """A copy of a class template (see _class_template) onward from `state`."""
        inner, first_edges, inner_edges = template
        if not first_edges:
            self.dead_ends = True
        end = self.states(inner + 1)  # local 0: the end; 1..inner: states inside the class
        self.edges[state].extend((low, high, end + to) for low, high, to in first_edges)
        for src, low, high, to in inner_edges:
            self.edges[end + src].append((low, high, end + to))
        return end


def _template_bytes(args: tuple, template: tuple) -> int:
    return PAIR_BYTES * len(args[0]) + EDGE_BYTES * (len(template[1]) + len(template[2]))


@bounded_cache(CLASS_CACHE_BYTES, _template_bytes)
def _class_template(ranges: tuple[tuple[int, int], ...]) -> tuple[int, list, list]:
    """A class's byte automaton in local numbering (0: the end state, 1..n: inner states;
    sequences that end alike share their inner states): (n, edges from the start, inner edges)."""
    suffixes: dict[tuple, int] = {(): 0}
    first_edges, inner_edges = [], []
    for seq in _utf8_sequences(ranges):
        target = 0
        for k in range(len(seq) - 1, 0, -1):
            suffix = seq[k:]
            local = suffixes.get(suffix)
            if local is None:
                local = suffixes[suffix] = len(suffixes)
                inner_edges.append((local, *seq[k], target))
            target = local
        first_edges.append((*seq[0], target))
    return len(suffixes) - 1, first_edges, inner_edges


def _prune(eps: list[list[int]], edges: list[list[tuple[int, int, int]]], final: int) -> None:
    """Drops the edges into states that cannot reach `final`."""
    reverse: list[list[int]] = [[] for _ in eps]
    for src in range(len(eps)):
        for dst in eps[src]:
            reverse[dst].append(src)
        for _low, _high, dst in edges[src]:
            reverse[dst].append(src)
    live = bytearray(len(eps))
    live[final] = 1
    stack = [final]
    while stack:
        for src in reverse[stack.pop()]:
            if not live[src]:
                live[src] = 1
                stack.append(src)
    for s in range(len(eps)):
        eps[s] = [d for d in eps[s] if live[d]] if live[s] else []
        edges[s] = [e for e in edges[s] if live[e[2]]] if live[s] else []


# -- character classes -------------------------------------------------------------------------


def _class_ranges(items, regex: str) -> tuple[tuple[int, int], ...]:
    try:
        return _ranges_of(tuple(items))
    except ValueError as e:
        raise ConstraintError(
            f"unsupported regex feature in {_short(regex)}: {e} in a class"
        ) from None


def _ranges_bytes(args: tuple, ranges: tuple) -> int:
    return PAIR_BYTES * (len(args[0]) + len(ranges))


@bounded_cache(
    CLASS_CACHE_BYTES, _ranges_bytes
)  # a schema's regex repeats its classes thousands of times
def _ranges_of(items: tuple) -> tuple[tuple[int, int], ...]:
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
            raise ValueError(str(op).lower())
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
        raise ValueError(name.lower())
    return _complement(ranges) if negated else ranges


@cache
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


def _sequences_bytes(args: tuple, sequences: tuple) -> int:
    return PAIR_BYTES * (len(args[0]) + sum(len(seq) for seq in sequences))


@bounded_cache(CLASS_CACHE_BYTES, _sequences_bytes)
def _utf8_sequences(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The code point ranges as sequences of byte ranges, one byte range per UTF-8 byte."""
    out: list[tuple[tuple[int, int], ...]] = []
    for low, high in ranges:
        for a, b in _without_surrogates(low, high):
            for limit_low, limit_high in zip(
                (0,) + tuple(x + 1 for x in _UTF8_LIMITS[:-1]), _UTF8_LIMITS
            ):
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
