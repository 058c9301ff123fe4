"""llguidance's error text as a plain sentence (one mapping for its syntax errors, its
matchers' failures and its limits): never its parser state dump. No imports but `re`."""

from __future__ import annotations

import re

MAX_MESSAGE_CHARS = 600

_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*")
_LIMIT = re.compile(r"^(lexer|parser) error:\s*(.*)$", re.IGNORECASE)
_NO_STRING = ("NoExtension", "NoExtensionBias")


def plain_error(message: str) -> str:
    """llguidance's error text as one plain sentence: its position `at 2(6):` as `line 2,
    column 6:`, its source excerpt, parser state dump (`<state>...`) and grammar echo
    left out; a grammar that can match nothing (`NoExtensionBias`) as "the grammar matches
    no string"; a lexer or parser limit named as such, with what to change."""
    head, _, state = message.strip().partition("<state>")
    first = head.strip().split("\n", 1)[0].strip()
    if first in _NO_STRING:
        return _no_string(state)
    limit = _LIMIT.match(first)
    if limit and _is_limit(limit.group(2)):
        return _shorter(
            f"the grammar is past llguidance's {limit.group(1).lower()} limit "
            f"({_clean(limit.group(2))}); lower its counted repeats or simplify its rules"
        )
    return _shorter(_POSITION.sub(r"line \1, column \2: ", first))


def _no_string(state: str) -> str:
    if re.search(r"^Tokens: ⟦⟧", state, re.MULTILINE) or not state:
        return "the grammar matches no string (a rule never reaches an end)"
    return "no string the grammar matches continues the output so far (a rule never reaches an end)"


def _is_limit(text: str) -> bool:
    text = text.lower()
    return "too many" in text or "limit" in text or "fuel" in text


def _clean(text: str) -> str:
    """`Too many items (limit 50000; ff_tokens); try avoiding ...` -> `too many items (limit
    50000)`: the part that says what was passed."""
    text = re.sub(r";\s*try .*$", "", text.strip())
    text = re.sub(r"\(limit (\d+);[^)]*\)", r"(limit \1)", text)
    return text[:1].lower() + text[1:]


def _shorter(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " ..."
