"""Size caps checked before any automaton is built, and the regex syntax check.

Measured with SmolLM2's 49,152-token vocabulary (outlines-core 0.2.14, one CPU core):
a string field `{"type": "string", "maxLength": n}` costs about 10 index states, 46k
transitions, 0.5 MB and 4 ms of build time per unit of n, linearly:

    maxLength    60: 0.23 s,  609 states,  30 MB      maxLength  500: 2.0 s, 198 MB
    maxLength   200: 0.84 s, 2009 states,  95 MB      maxLength 1000: 4.1 s, 314 MB

An unbounded string (no maxLength) is a loop: a few states. So bounded lengths are capped at
MAX_STRING_LENGTH (about 1 s and 130 MB for one field at the cap), and every regex at
MAX_EXPANDED_SIZE expanded positions (repeats multiplied out), which bounds the DFA of the
deterministic regexes JSON schemas produce (a 256-char string field expands to ~800).
Regexes whose determinization explodes (`(a|b)*a(a|b){14}`: 28 s) are caught only by the
compile timeout.
"""

from __future__ import annotations

import re

import interegular

from spruce.constrained.patterns import END_MARK
from spruce.constrained.errors import ConstraintError

MAX_STRING_LENGTH = 256  # JSON schema minLength / maxLength
MAX_ARRAY_ITEMS = 64  # JSON schema minItems / maxItems (the item regex is repeated)
_DOTALL_FLAG = re.compile(r"\(\?[a-zA-Z-]*s[a-zA-Z-]*[:)]")
_END_MARK_ESCAPE = re.compile(r"\\(x\{0*10ffff\}|U0010ffff)", re.IGNORECASE)
MAX_EXPANDED_SIZE = 4096  # ~5 string fields at the length cap: ~5 s, ~700 MB with 49k tokens


def parse_regex(regex: str) -> object:
    """Parses with both Python `re` (syntax) and interegular (the features the automata
    support); raises ConstraintError naming the problem. Returns interegular's tree."""
    try:
        re.compile(regex)
    except re.error as e:
        raise ConstraintError(f"invalid regex {_short(regex)}: {e}") from None
    if _DOTALL_FLAG.search(regex):
        raise ConstraintError(f"unsupported regex feature in {_short(regex)}: the s (dot-all) flag")
    if END_MARK in regex or _END_MARK_ESCAPE.search(regex):
        raise ConstraintError(f"regex {_short(regex)} uses U+10FFFF, reserved as the end marker")
    try:
        tree = interegular.parse_pattern(regex)
    except Exception as e:  # interegular raises its own Unsupported / InvalidSyntax types
        raise ConstraintError(f"unsupported regex feature in {_short(regex)}: {e}") from None
    if _has_lookaround(tree):
        raise ConstraintError(f"unsupported regex feature in {_short(regex)}: lookaround")
    return tree


def check_regex_size(regex: str, tree: object | None = None) -> None:
    size = expanded_size(tree if tree is not None else parse_regex(regex))
    if size > MAX_EXPANDED_SIZE:
        raise ConstraintError(
            f"constraint too large: the regex expands to about {size} positions (cap "
            f"{MAX_EXPANDED_SIZE}); lower the bounded repeats (maxLength, maxItems, {{m,n}})"
        )


def expanded_size(node: object) -> int:
    """Number of character positions once bounded repeats are multiplied out."""
    if hasattr(node, "options"):
        return sum(expanded_size(option) for option in node.options)
    if hasattr(node, "parts"):
        return sum(expanded_size(part) for part in node.parts)
    if hasattr(node, "base"):
        repeats = node.max if node.max is not None else max(node.min, 1)
        return expanded_size(node.base) * max(repeats, 1)
    if hasattr(node, "inner"):
        return expanded_size(node.inner)
    return 1


def _has_lookaround(node: object) -> bool:
    if hasattr(node, "inner"):
        return True
    children = getattr(node, "options", None) or getattr(node, "parts", None) or ()
    if hasattr(node, "base"):
        children = (node.base,)
    return any(_has_lookaround(child) for child in children)


def _short(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")
