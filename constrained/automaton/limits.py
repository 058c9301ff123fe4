"""Size caps checked before any automaton is built.

A regex becomes a byte-level NFA of a few states per expanded position (repeats multiplied
out: a 256-character JSON string field expands to ~770 positions and ~5,100 states), built
at about 150k states per second; its DFA is made lazily, only where requests go (see
byte_dfa.py), so the NFA's size is what a constraint costs up front. MAX_EXPANDED_SIZE
bounds it: at the cap, a JSON schema's regex builds in under a second (~100k states, about
20 MB). Bounded lengths and counts have their own caps (a field of MAX_STRING_LENGTH, an
array of MAX_ARRAY_ITEMS items); past them, or past the total, lenient mode relaxes the
heaviest parts of a schema (schema_size.py) and strict mode refuses it, naming them.
"""

from __future__ import annotations

import re

from spruce.constrained.automaton.byte_nfa import parse_regex
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.memory import bounded_cache, text_bytes

MAX_STRING_LENGTH = 256  # JSON schema minLength / maxLength
MAX_ARRAY_ITEMS = 64  # JSON schema minItems / maxItems (the item regex is repeated)
MAX_EXPANDED_SIZE = 32768  # was 4096 while an eager token index was built for every state
REGEX_SIZE_CACHE_BYTES = 16 * 2**20  # regex_size's memo (keyed by regex text: request data)


def check_regex_size(regex: str, tree: object | None = None) -> None:
    """ConstraintError past MAX_EXPANDED_SIZE (`tree`, the regex's parse tree, is parsed if
    not given: the syntax is checked too)."""
    if tree is None:
        parse_regex(regex)
    size = regex_size(regex)
    if size > MAX_EXPANDED_SIZE:
        raise ConstraintError(
            f"constraint too large: the regex expands to about {size} positions (cap "
            f"{MAX_EXPANDED_SIZE}); lower the bounded repeats (maxLength, maxItems, {{m,n}})"
        )


_TOKEN = re.compile(
    r"(?P<run>[^\\\[\](){}|*+?.]+)"
    r"|(?P<atom>\\x\{[0-9A-Fa-f]+\}|\\x[0-9A-Fa-f]{2}|\\u[0-9A-Fa-f]{4}|\\.|\[\^?\]?(?:\\.|\[:[a-z]+:\]|[^\]\\])*\])"
    r"|(?P<open>\((?:\?(?:P<\w+>|[:=!]|<[=!]|[a-zA-Z-]+:))?)"
    r"|(?P<close>\))"
    r"|(?P<repeat>\{(?P<low>\d*)(?P<comma>,?)(?P<high>\d*)\}\??)"
    r"|(?P<other>[*+?]\??|\||.)",
    re.DOTALL,
)


# schema_size measures every part, round after round (cleared per schema)
@bounded_cache(REGEX_SIZE_CACHE_BYTES, lambda args, _: text_bytes(args[0]) + 100)
def regex_size(regex: str) -> int:
    """Number of character positions once bounded repeats are multiplied out (`a{3}` is 3,
    `(ab){2,5}` is 10, `a*` is 1, alternatives add up): a bound on the DFA of the
    deterministic regexes JSON schemas produce. Linear in the text; an estimate for odd
    syntax, never an error."""
    sums, last = [0], 0
    for token in _TOKEN.finditer(regex):
        kind = token.lastgroup
        if kind == "run":
            sums[-1] += len(token.group())
            last = 1
        elif kind == "atom" or (kind == "other" and token.group() == "."):
            sums[-1] += 1
            last = 1
        elif kind == "open":
            sums.append(0)
            last = 0
        elif kind == "close" and len(sums) > 1:
            last = sums.pop()
            sums[-1] += last
        elif kind == "repeat":
            factor = _repeat_factor(token)
            sums[-1] += last * (factor - 1)
            last *= factor
    return sum(sums)


def regex_lengths(regex: str) -> tuple[int, int | None]:
    """(shortest, longest) length of the strings `regex` matches (None: unbounded), read
    from the text as `regex_size` reads it; an estimate for odd syntax."""
    frames = [[None, None, 0, 0]]  # per group: best (min, max) over alternatives, current sequence
    last = (0, 0)
    for token in _TOKEN.finditer(regex):
        kind, text, frame = token.lastgroup, token.group(), frames[-1]
        if kind == "run" or kind == "atom" or (kind == "other" and text == "."):
            count = len(text) if kind == "run" else 1
            frame[2], frame[3] = frame[2] + count, _add(frame[3], count)
            last = (1, 1)
        elif kind == "open":
            frames.append([None, None, 0, 0])
        elif kind == "close" and len(frames) > 1:
            last = _close(frames.pop())
            frames[-1][2], frames[-1][3] = frames[-1][2] + last[0], _add(frames[-1][3], last[1])
        elif kind == "repeat" or (kind == "other" and text[0] in "*+?"):
            low, high = _repeat_bounds(token) if kind == "repeat" else _QUANTIFIERS[text[0]]
            repeated = (last[0] * low, None if high is None or last[1] is None else last[1] * high)
            frame[2] += repeated[0] - last[0]
            grown = None if repeated[1] is None else repeated[1] - last[1]
            frame[3] = _add(frame[3], grown)
            last = repeated
        elif kind == "other" and text == "|":
            frame[0], frame[1] = _close(frame)
            frame[2], frame[3] = 0, 0
    return _close(frames[0])


_QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}


def _add(total: int | None, count: int | None) -> int | None:
    return None if total is None or count is None else total + count


def _close(frame: list) -> tuple[int, int | None]:
    """A group's (min, max) over its alternatives, the current one included."""
    if frame[0] is None:
        return frame[2], frame[3]
    high = None if frame[1] is None or frame[3] is None else max(frame[1], frame[3])
    return min(frame[0], frame[2]), high


def _repeat_bounds(token: re.Match) -> tuple[int, int | None]:
    low, high = token.group("low"), token.group("high")
    if not token.group("comma"):
        return (int(low), int(low)) if low else (1, 1)
    return int(low or 0), int(high) if high else None


def _repeat_factor(token: re.Match) -> int:
    low, high = token.group("low"), token.group("high")
    if high:
        return max(int(high), 1)
    if not token.group("comma") and not low:  # "{}": a literal brace
        return 1
    return max(int(low or 0), 1)


def _short(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")
