"""Type checks for JSON-like request values, shared by SamplingParams and the validation
boundary (a bool is never an int here; a number is finite)."""

from __future__ import annotations

import math
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
