"""JSON schema scalars -> regex: strings (lengths, patterns, formats, intersected on automata)
and numbers (bounds, multipleOf). `flat` is one normalized alternative (schema_normalize)."""

from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction
from typing import Any

from interegular.fsm import FSM, Alphabet, anything_else

from spruce.constrained.automaton.automata import (
    MAX_AUTOMATON_STATES,
    can_emit,
    fsm_to_regex,
    intersect_regexes,
    literal_text,
    regex_fsm,
    subtract_regexes,
)
from spruce.constrained.automaton.byte_nfa import parse_regex
from spruce.constrained.automaton.limits import MAX_STRING_LENGTH, regex_lengths, regex_size
from spruce.constrained.core.errors import ConstraintError, TooLarge
from spruce.constrained.core.patterns import (
    FORMAT_REGEXES,
    JSON_FRACTION,
    JSON_INTEGER,
    JSON_NUMBER,
    JSON_STRING_CHAR,
)
from spruce.constrained.core.ranges import integer_range_regex, number_range_regex
from spruce.constrained.schema.schema_context import BOUNDS, CONTENT, Context
from spruce.constrained.schema.schema_validator import (
    leading_lookaheads,
    plain_groups,
    top_level_branches,
)

SAFE_CHAR = r'[^"\\\x00-\x1F]'  # a string character that needs no JSON escape
_JSON_ESCAPED = frozenset('"\\' + "".join(map(chr, range(0x20))))
MAX_MULTIPLE = 1000  # multipleOf k builds a k-state automaton
MAX_MULTIPLE_REGEX = 20_000  # its regex (7 -> 44k characters: refused)
MAX_LISTED_MULTIPLES = 256  # a bounded multipleOf lists its values
MAX_LENGTH_STATES = 150  # a pattern / format intersected with lengths (state elimination is cubic)
MAX_LENGTH_PRODUCT = 2000  # its positions times the length bound: the product automaton's size


# -- strings ------------------------------------------------------------------------------------


def string_regex(flat: dict, ctx: Context) -> str | None:
    """A regex for the JSON string token (quotes included); None when no string fits."""
    low, high = _length_bounds(flat, ctx)
    if high is not None and low > high:
        return None
    parts = _string_parts(flat, ctx)
    if parts and _implied(parts, low, high):
        low, high = 0, None
    if not parts:
        content = f"{JSON_STRING_CHAR}{_repeat(low, high)}"
    elif len(parts) == 1 and (low, high) == (0, None):
        content = parts[0]
    else:
        content = _bounded(parts, low, high, flat, ctx)
    excluded = [
        literal_text(json.dumps(v)[1:-1]) for v in flat.get("not_values", []) if isinstance(v, str)
    ]
    if content is not None and excluded:
        content = subtract_regexes(content, excluded)
    return None if content is None else f'"{content}"'


def _implied(parts: list[str], low: int, high: int | None) -> bool:
    """Whether one pattern / format alone keeps every string within the lengths (a date
    under maxLength 32): nothing to intersect."""
    for part in parts:
        shortest, longest = regex_lengths(part)
        if shortest >= low and (high is None or (longest is not None and longest <= high)):
            return True
    return False


def _bounded(parts: list[str], low: int, high: int | None, flat: dict, ctx: Context) -> str | None:
    """The patterns / formats intersected with the lengths. Past MAX_LENGTH_STATES automaton
    states (seconds of work, a huge regex) the lengths are left out, then all patterns but
    the first: reported (lenient mode) or refused (strict), naming the path."""
    lengths = [] if (low, high) == (0, None) else [f"{SAFE_CHAR}{_repeat(low, high)}"]
    if not lengths and len(parts) == 1:
        return parts[0]
    try:
        product = max(regex_size(p) for p in parts) * ((low if high is None else high) + 1)
        if lengths and product > MAX_LENGTH_PRODUCT:  # the product automaton alone takes seconds
            raise TooLarge(f"about {product} automaton states")
        return _intersect([*parts, *lengths], MAX_LENGTH_STATES)
    except TooLarge as e:
        why = f"intersecting it with the other string constraints is too large: {e}"
        if high is not None:  # the upper bound costs most: the lower one may still fit
            ctx.skip("maxLength", flat["path"], why)
            return (
                _bounded(parts, low, None, flat, ctx)
                if low > 0
                else _bounded(parts, 0, None, flat, ctx)
            )
        if lengths:
            ctx.skip("minLength", flat["path"], why)
            return parts[0] if len(parts) == 1 else _bounded(parts, 0, None, flat, ctx)
        ctx.skip("pattern" if flat.get("patterns") else "format", flat["path"], why)
        return parts[0]


def _length_bounds(flat: dict, ctx: Context) -> tuple[int, int | None]:
    low, high = flat.get("minLength", 0), flat.get("maxLength")
    path = flat["path"]
    if high is not None and not ctx.keeps(BOUNDS, path, "maxLength"):
        high = None
    if low > 1 and not ctx.keeps(BOUNDS, path, "minLength"):
        low = 0
    if high is not None and high > MAX_STRING_LENGTH:
        ctx.skip("maxLength", path, f"{high} is above the cap of {MAX_STRING_LENGTH} (each bounded "
                 "character grows the automaton)")  # fmt: skip
        high = None
    if low > MAX_STRING_LENGTH:
        ctx.skip("minLength", path, f"{low} is above the cap of {MAX_STRING_LENGTH}")
        low = 0
    return low, high


def _repeat(low: int, high: int | None) -> str:
    if (low, high) == (0, None):
        return "*"
    return f"{{{low},}}" if high is None else f"{{{low},{high}}}"


def _string_parts(flat: dict, ctx: Context) -> list[str]:
    parts = []
    enforced = {
        "patterns": flat.get("patterns"),
        "formats": [f for f in flat.get("formats", []) if f[0] in FORMAT_REGEXES],
    }
    for keyword, key in (("pattern", "patterns"), ("format", "formats")):
        if enforced[key] and not ctx.keeps(CONTENT, flat["path"], keyword):
            flat = {k: v for k, v in flat.items() if k != key}
    for pattern, path in flat.get("patterns", []):
        regex = pattern_regex(pattern, path, ctx)
        if regex is not None:
            parts.append(regex)
    for name, _path in flat.get("formats", []):
        if name in FORMAT_REGEXES:
            parts.append(FORMAT_REGEXES[name])
    return list(dict.fromkeys(parts))  # allOf parts often repeat a format or pattern


def _intersect(regexes: list[str], max_states: int = MAX_AUTOMATON_STATES) -> str | None:
    fsm = regex_fsm(regexes[0])
    for regex in regexes[1:]:
        fsm = fsm & regex_fsm(regex)
    return fsm_to_regex(fsm, max_states)


def pattern_regex(pattern: Any, path: str, ctx: Context) -> str | None:
    """A JSON Schema pattern (a search, anchored only where it says so) as a full-match regex
    of unescaped JSON string characters; None (after ctx.skip) when it cannot be used."""
    if not isinstance(pattern, str):
        ctx.skip("pattern", path, "pattern must be a string")
        return None
    try:
        regex = narrow_classes(pattern_search_regex(pattern))
        parse_regex(regex)
        if can_emit(regex, _JSON_ESCAPED):
            regex = _intersect([regex, f"{SAFE_CHAR}*"])
    except Exception as e:  # noqa: BLE001 - ConstraintError from the parsers, or interegular's own errors
        ctx.skip("pattern", path, f"the regex {pattern!r} is not supported ({e})")
        return None
    return regex


def pattern_search_regex(pattern: str) -> str:
    """A search pattern as a full-match regex: `.*` added where it is not anchored; named
    groups (ECMA `(?<name>...)`, Python `(?P<name>...)`) become plain groups, and lookaheads
    at the start of an anchored alternative become automaton intersections / differences."""
    branches = [_branch_regex(b) for b in top_level_branches(plain_groups(pattern))]
    kept = [b for b in branches if b is not None]
    if not kept:
        raise ConstraintError("it matches no string")
    return "|".join(kept)


def _branch_regex(branch: str) -> str | None:
    """`^(?=A)(?!B)C` -> C & (A.*) - (B.*) (`A$` inside a lookahead: A exactly); None
    when no string matches."""
    lookaheads, rest = leading_lookaheads(branch)
    regex = _anchored(rest)
    for negative, inner in lookaheads:
        condition = _anchored("^" + inner)
        regex = (
            subtract_regexes(regex, [condition])
            if negative
            else intersect_regexes([regex, condition])
        )
        if regex is None:
            return None
    return regex


def _anchored(branch: str) -> str:
    """One top-level alternative of a search pattern as a full match."""
    head = "" if branch.startswith("^") else f"{SAFE_CHAR}*"
    body = branch.removeprefix("^")
    ends = (
        body.endswith("$") and (len(body) - 1 - len(body[:-1].rstrip("\\"))) % 2 == 0
    )  # not "\\$"
    tail = "" if ends else f"{SAFE_CHAR}*"
    body = body[:-1] if ends else body
    return f"{head}(?:{body}){tail}"


def narrow_classes(pattern: str) -> str:
    """'.' and negated classes narrowed to exclude '"', '\\' and control characters."""
    out, i, in_class, negated = [], 0, False, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if not in_class and char == "[":
            j = i + 1
            negated = pattern.startswith("^", j)
            j += negated
            j += pattern.startswith("]", j)
            out.append(pattern[i:j])
            in_class, i = True, j
            continue
        if in_class and char == "]":
            out.append(r'"\\\x00-\x1F]' if negated else "]")
            in_class = False
        elif not in_class and char == ".":
            out.append(SAFE_CHAR)
        else:
            out.append(char)
        i += 1
    return "".join(out)


# -- numbers ------------------------------------------------------------------------------------


def integer_regex(flat: dict, ctx: Context) -> str | None:
    low, high = _integer_bounds(flat)
    if low is not None and high is not None and low > high:
        return None
    step = _integer_step(flat, ctx)
    if step is not None and step > 1:
        regex = _multiples(low, high, step, flat, ctx)
    else:
        regex = JSON_INTEGER if low is None and high is None else integer_range_regex(low, high)
    return _without_values(regex, flat, (int,))


def _multiples(
    low: int | None, high: int | None, step: int, flat: dict, ctx: Context
) -> str | None:
    if low is not None and high is not None and (high - low) // step <= MAX_LISTED_MULTIPLES:
        values = [str(v) for v in range(low + (-low) % step, high + 1, step)]
        return "(?:" + "|".join(values) + ")" if values else None
    multiples = _multiple_fsm_regex(step)
    if len(multiples) > MAX_MULTIPLE_REGEX:
        ctx.skip("multipleOf", flat["path"], f"the regex for multiples of {step} is too large")
        multiples = JSON_INTEGER
    if low is None and high is None:
        return multiples
    return _intersect([integer_range_regex(low, high), multiples])


def number_regex(flat: dict, ctx: Context, integers: bool) -> str | None:
    """Numbers of the alternative; `integers`: whether integral values are allowed."""
    if flat.get("multipleOf"):
        return _number_multiple(flat, ctx, integers)
    low, high = _number_bounds(flat, ctx)
    if low is None and high is None:
        regex = JSON_NUMBER
    elif (
        low is not None
        and high is not None
        and (low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1])))
    ):
        return None
    else:
        regex = number_range_regex(
            None if low is None else int(low[0]), None if high is None else int(high[0]),
            bool(low and low[1]), bool(high and high[1]),
        )  # fmt: skip
    if not integers and regex == JSON_NUMBER:  # written directly: the intersection is huge
        regex = JSON_FRACTION
    elif not integers:  # a fraction that is not zero ("2.0" is an integer in JSON Schema)
        regex = _intersect([regex, r"-?[0-9]+\.[0-9]*[1-9]"])
    return regex if regex is None else _without_values(regex, flat, (int, float))


def _number_multiple(flat: dict, ctx: Context, integers: bool) -> str | None:
    steps = [Fraction(Decimal(str(v))) for v, _ in flat["multipleOf"]]
    if all(s.denominator == 1 for s in steps):
        return integer_regex(flat, ctx) if integers else None
    step = steps[0]
    if len(steps) > 1 or step.numerator != 1 or str(step.denominator).rstrip("0") != "1":
        ctx.skip(
            "multipleOf", flat["path"], f"only integers and 1/10^n are supported (got {steps[0]})"
        )
        return number_regex({k: v for k, v in flat.items() if k != "multipleOf"}, ctx, integers)
    digits = len(str(step.denominator)) - 1
    fraction = rf"-?(?:0|[1-9][0-9]{{0,15}})(?:\.[0-9]{{1,{digits}}})?"
    bounded = number_regex({k: v for k, v in flat.items() if k != "multipleOf"}, ctx, True)
    return None if bounded is None else _intersect([bounded, fraction])


def _integer_bounds(flat: dict) -> tuple[int | None, int | None]:
    low = high = None
    if "low" in flat:
        value, exclusive = flat["low"]
        value = Fraction(Decimal(str(value)))
        low = value.__floor__() + 1 if exclusive else value.__ceil__()
    if "high" in flat:
        value, exclusive = flat["high"]
        value = Fraction(Decimal(str(value)))
        high = value.__ceil__() - 1 if exclusive else value.__floor__()
    return low, high


def _number_bounds(flat: dict, ctx: Context):
    bounds = []
    for key, name in (("low", "minimum"), ("high", "maximum")):
        bound = flat.get(key)
        if bound is not None and Fraction(Decimal(str(bound[0]))).denominator != 1:
            ctx.skip(name, flat["path"], f"a fractional bound ({bound[0]}) on a number")
            bound = None
        bounds.append(bound)
    return bounds[0], bounds[1]


def _integer_step(flat: dict, ctx: Context) -> int | None:
    step = 1
    for value, _path in flat.get("multipleOf", []):
        fraction = Fraction(Decimal(str(value)))
        if fraction.denominator != 1:
            step = step * fraction.denominator // _gcd(step, fraction.denominator)
            continue  # an integer is a multiple of 1/k; of p/q only when p | it
        step = step * int(fraction) // _gcd(step, int(fraction))
    if step > MAX_MULTIPLE:
        ctx.skip("multipleOf", flat["path"], f"{step} is above the cap of {MAX_MULTIPLE}")
        return None
    return step


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _multiple_fsm_regex(step: int) -> str:
    """Canonical decimal integers divisible by `step`, as a regex."""
    digits = "0123456789"
    mapping = {d: i for i, d in enumerate(digits)} | {"-": 10, anything_else: 11}
    alphabet = Alphabet(mapping)
    start, minus, zero = "start", "minus", "zero"
    transitions: dict = {start: {10: minus, 0: zero}, minus: {}, zero: {}}
    for d in range(1, 10):
        transitions[start][d] = d % step
        transitions[minus][d] = d % step
    for remainder in range(step):
        transitions[remainder] = {d: (remainder * 10 + d) % step for d in range(10)}
    fsm = FSM(alphabet, set(transitions), start, {zero, 0}, transitions)
    regex = fsm_to_regex(fsm)
    assert regex is not None
    return regex


def _without_values(regex: str | None, flat: dict, kinds: tuple) -> str | None:
    excluded = [
        literal_text(json.dumps(v)) for v in flat.get("not_values", [])
        if isinstance(v, kinds) and not isinstance(v, bool)
    ]  # fmt: skip
    if regex is None or not excluded:
        return regex
    return subtract_regexes(regex, excluded)
