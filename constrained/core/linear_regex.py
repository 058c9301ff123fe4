"""User regexes matched in linear time (RE2), for every check at serving time: stop_regex
after each token, JSON Schema `pattern` / `patternProperties` when an output is validated.
Python's `re` backtracks (`(a+)+b` on 30 a's takes minutes), so it is kept for our own fixed
patterns only.

Patterns use Python's syntax as far as RE2 has it, rewritten where the meaning would differ:

- `\\w` and `\\s` are Unicode, as in Python's `re` and the byte automaton (`\\w`: letters,
  digits and `_`, i.e. `[\\p{L}\\p{N}_]`; `\\s`: what `str.isspace` takes); `\\W` and `\\S`
  outside a class are their complements. Inside a class `\\W` and `\\S` keep RE2's ASCII
  meaning (`[\\s\\S]` is still any character). Newly assigned characters may differ where
  RE2's Unicode tables are newer than Python's.
- `\\d` is `[0-9]` (ECMA 262 and the byte automaton; Python's `re` also takes other digits),
  and `\\b` is an ASCII word boundary.
- `\\uXXXX` / `\\UXXXXXXXX` become `\\x{...}`, `\\Z` becomes `\\z`, `{,n}` becomes `{0,n}`.
- Named groups in either spelling, ECMA's `(?<name>...)` and Python's `(?P<name>...)`.
- `$` matches only at the very end (ECMA's meaning; Python's `re` also before a final
  newline).
- Refused, with the reason (`UnsupportedRegex`): backreferences, lookaround, atomic groups,
  possessive repeats, counted repeats over 1000, inline flags other than i / m / s / U, and a
  pattern whose compiled form passes MAX_PATTERN_MEMORY.

Compiled patterns are kept in a cache bounded by their estimated bytes (the pattern text
and the compiled program), so request data cannot grow it without bound.
"""

from __future__ import annotations

import re
from string import hexdigits

import re2

from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.memory import BoundedCache, text_bytes

MAX_PATTERN_MEMORY = 4 << 20  # bytes RE2 may use per compiled pattern (program and DFA cache)
MAX_CACHED_BYTES = 32 << 20  # compiled patterns kept, by their estimated bytes
# Measured (RSS): a compiled program costs ~16 bytes per instruction; twice that for the
# reverse program RE2 may build when searching. A 40-character pattern can be 270k instructions.
PROGRAM_BYTES_PER_INSTRUCTION = 32

_WORD = r"\p{L}\p{N}_"
_SPACE = r"\t\n\x0b\f\r\x1c-\x20\x85\xa0\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
_SHORTHANDS = {"w": (_WORD, False), "W": (_WORD, True), "s": (_SPACE, False), "S": (_SPACE, True)}
_HEX_ESCAPE = {"u": 4, "U": 8}
_EMPTY_LOW_BOUND = re.compile(r"\{,(\d+)\}")

# What RE2 says -> the reason a user reads.
_REASONS = (
    (re.compile(r"invalid escape sequence: \\[1-9]"), "backreferences are not supported"),
    (
        re.compile(r"invalid perl operator: \(\?<?[=!]"),
        "lookaround ((?=, (?!, (?<=, (?<!) is not supported",
    ),
    (re.compile(r"invalid perl operator: \(\?>"), "atomic groups are not supported"),
    (
        re.compile(r"bad repetition operator: (?:[*+?]|\{[\d,]*\})\+"),
        "possessive repeats are not supported",
    ),
    (re.compile(r"invalid repetition size"), "counted repeats go up to 1000"),
    (re.compile(r"pattern too large"), f"it compiles to more than {MAX_PATTERN_MEMORY >> 20} MiB"),
)


class UnsupportedRegex(ConstraintError):
    """A regex the linear-time engine cannot take; the message says why."""

    def __init__(self, pattern: str, reason: str) -> None:
        super().__init__(f"the regex {pattern[:80]!r} cannot be matched in linear time: {reason}")
        self.pattern = pattern
        self.reason = reason


def check(pattern: str) -> None:
    """UnsupportedRegex when `pattern` cannot be compiled."""
    _compiled(pattern)


def search(pattern: str, text: str, start: int = 0) -> tuple[int, int] | None:
    """(start, end) of the first match in text[start:] (`^` still means the text's start,
    as with Python's `Pattern.search(text, pos)`); None when there is none."""
    match = _compiled(pattern).search(text, start)
    return None if match is None else match.span()


def fullmatch(pattern: str, text: str) -> bool:
    return _compiled(pattern).fullmatch(text) is not None


def translate(pattern: str) -> str:
    """The pattern in RE2's spelling, with the meanings the module docstring lists."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            piece, i = _escape(pattern, i, in_class)
            out.append(piece)
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            j = i + 1 + pattern.startswith("^", i + 1)
            j += pattern.startswith("]", j)  # a leading ']' is a literal
            out.append(pattern[i:j])
            in_class, i = True, j
            continue
        elif char == "{" and (bound := _EMPTY_LOW_BOUND.match(pattern, i)):
            out.append(f"{{0,{bound.group(1)}}}")
            i = bound.end()
            continue
        out.append(char)
        i += 1
    return "".join(out)


def _escape(pattern: str, i: int, in_class: bool) -> tuple[str, int]:
    """The RE2 spelling of the escape at pattern[i] and the index after it."""
    letter = pattern[i + 1]
    if letter in _SHORTHANDS and not (in_class and _SHORTHANDS[letter][1]):
        body, negated = _SHORTHANDS[letter]
        return (body if in_class else f"[{'^' if negated else ''}{body}]"), i + 2
    code = pattern[i + 2 : i + 2 + _HEX_ESCAPE.get(letter, 0)]
    if code and len(code) == _HEX_ESCAPE[letter] and all(c in hexdigits for c in code):
        return f"\\x{{{code}}}", i + 2 + len(code)
    if letter == "Z" and not in_class:
        return r"\z", i + 2
    return pattern[i : i + 2], i + 2


_CACHE = BoundedCache(MAX_CACHED_BYTES)


def _options():
    options = re2.Options()
    options.max_mem = MAX_PATTERN_MEMORY
    options.log_errors = False
    options.never_capture = True  # spans only
    return options


_OPTIONS = _options()


def _compiled(pattern: str):
    compiled = _CACHE.get(pattern)
    if compiled is None:
        compiled = _compile(pattern)
        _CACHE.put(
            pattern,
            compiled,
            text_bytes(pattern) + PROGRAM_BYTES_PER_INSTRUCTION * compiled.programsize,
        )
    return compiled


def _compile(pattern: str):
    if not isinstance(pattern, str):
        raise UnsupportedRegex(repr(pattern), "a regex must be a string")
    try:
        return re2.compile(translate(pattern), _OPTIONS)
    except re2.error as e:
        raise UnsupportedRegex(pattern, _reason(pattern, e)) from None


def _reason(pattern: str, error: Exception) -> str:
    if "(?P=" in pattern:
        return "backreferences are not supported"
    message = error.args[0] if error.args else str(error)
    message = message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)
    for found, reason in _REASONS:
        if found.search(message):
            return reason
    return message
