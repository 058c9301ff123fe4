"""Type checks for JSON-like request values, shared by SamplingParams and the validation
boundary (a bool is never an int here; a number is finite), and the size of a text: its
bytes, and the least number of tokens a tokenizer can make of it (`TokenBound`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spruce.runtime.limits import INT64_MAX


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_int64(value: Any) -> bool:
    return is_int(value) and -INT64_MAX - 1 <= value <= INT64_MAX


def is_number(value: Any) -> bool:
    """A finite int or float (NaN and infinities are refused; an int too large for a float too)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def utf8_length(text: str) -> int:
    """The bytes of `text` in UTF-8 (no copy for ASCII text; a lone surrogate, which JSON
    may carry, counts the 3 bytes it encodes to with surrogatepass)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, slots=True)
class TokenBound:
    """What a tokenizer guarantees of any text (`Tokenizer.token_bound`): one token stands
    for at most `max_bytes` bytes of it, and nothing of it is dropped but the characters in
    `dropped` (ASCII characters without a token of their own), or, where `ascii_only`, bytes
    of non-ASCII characters too (then only ASCII text is bounded). So a text has at least
    `least_tokens(text)` tokens, known before it is tokenized."""

    max_bytes: int
    dropped: str = ""
    ascii_only: bool = False

    def least_tokens(self, text: str) -> int:
        if self.ascii_only and not text.isascii():
            return 0
        size = utf8_length(text) - sum(map(text.count, self.dropped))
        return -(-size // self.max_bytes)
