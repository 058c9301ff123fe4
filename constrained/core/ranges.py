"""Regexes for bounded JSON numbers (outlines-core ignores minimum / maximum).

Integers are matched in canonical decimal form (no leading zeros, no "-0"); bounded numbers as
`-?INT(\\.[0-9]+)?` without exponent, so every match parses with `json` and lies in range.
"""

from __future__ import annotations

_DIGITS = "[0-9]"


def integer_range_regex(low: int | None, high: int | None) -> str:
    """Regex for the integers in [low, high] (None = unbounded). Empty ranges are the
    caller's error (asserted)."""
    assert low is None or high is None or low <= high, (low, high)
    parts = []
    if low is None or low < 0:  # negative part: "-" then a magnitude in [max(1, -high), -low]
        magnitude_low = 1 if high is None or high >= 0 else -high
        parts.append("-" + _group(_natural_range(magnitude_low, None if low is None else -low)))
    if high is None or high >= 0:
        parts.append(_natural_range(max(low or 0, 0), high))
    return _alternation(parts)


def number_range_regex(
    low: int | None, high: int | None, exclusive_low: bool = False, exclusive_high: bool = False
) -> str:
    """Regex for decimals x with low <(=) x <(=) high; the bounds are integers (or None)."""
    parts = []
    if low is None or low < 0:  # negative values: "-" then a magnitude d > 0
        if high is None or high >= 0:
            d_low, d_low_exclusive = 0, True
        else:
            d_low, d_low_exclusive = -high, exclusive_high
        d_high = None if low is None else -low
        magnitude = _decimal_range(d_low, d_low_exclusive, d_high, exclusive_low)
        if magnitude:
            parts.append("-" + _group(magnitude))
    if high is None or high > 0 or (high == 0 and not exclusive_high):
        if low is None or low < 0:
            x_low, x_low_exclusive = 0, False
        else:
            x_low, x_low_exclusive = low, exclusive_low
        positive = _decimal_range(x_low, x_low_exclusive, high, exclusive_high)
        if positive:
            parts.append(positive)
    return _alternation(parts)


def _decimal_range(low: int, low_exclusive: bool, high: int | None, high_exclusive: bool) -> str:
    """Non-negative decimals in the interval; '' when it is empty."""
    any_fraction, zero_fraction = r"(\.[0-9]+)?", r"(\.0+)?"
    nonzero_fraction = r"\.[0-9]*[1-9][0-9]*"
    parts = []
    first_full = low + 1 if low_exclusive else low  # integer parts taking any fraction
    last_full = None if high is None else high - 1
    if last_full is None or first_full <= last_full:
        parts.append(_group(_natural_range(first_full, last_full)) + any_fraction)
    if low_exclusive and (high is None or low < high):
        parts.append(_group(str(low)) + nonzero_fraction)
    if high is not None and not high_exclusive and high >= first_full:
        parts.append(_group(str(high)) + zero_fraction)
    return "|".join(parts)


def _natural_range(low: int, high: int | None) -> str:
    """Canonical decimals of the integers in [low, high], low >= 0."""
    assert low >= 0 and (high is None or high >= low), (low, high)
    parts = []
    width = len(str(low))
    top = high if high is not None else None
    while top is None or width <= len(str(top)):
        start = low if width == len(str(low)) else 10 ** (width - 1)
        end = 10**width - 1 if top is None or width < len(str(top)) else top
        parts.append(_same_width(str(start), str(end)))
        if top is None:  # every wider number is >= low
            parts.append(f"[1-9]{_DIGITS}{{{width},}}")
            break
        width += 1
    return "|".join(parts)


def _same_width(low: str, high: str) -> str:
    """Regex for the decimal strings of one width between low and high (inclusive)."""
    if low == high:
        return low
    if len(low) == 1:
        return f"[{low}-{high}]"
    rest = len(low) - 1
    if low[0] == high[0]:
        return low[0] + _group(_same_width(low[1:], high[1:]))
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return f"[{low[0]}-{high[0]}]{_DIGITS}{{{rest}}}"
    parts = [low[0] + _group(_same_width(low[1:], "9" * rest))]
    if int(high[0]) - int(low[0]) > 1:
        parts.append(f"[{int(low[0]) + 1}-{int(high[0]) - 1}]{_DIGITS}{{{rest}}}")
    parts.append(high[0] + _group(_same_width("0" * rest, high[1:])))
    return "|".join(parts)


def _group(regex: str) -> str:
    return f"(?:{regex})" if "|" in regex else regex


def _alternation(parts: list[str]) -> str:
    assert parts, "empty numeric range"
    return f"(?:{'|'.join(parts)})"
