"""Objects -> regex: declared properties in a fixed order (definition or required-first, or any
order for small objects), then extra properties (patternProperties, additionalProperties,
propertyNames: key regexes built on automata, declared names excluded), with
minProperties / maxProperties counted."""

from __future__ import annotations

import json
import re
from itertools import combinations

from spruce.constrained.automaton.automata import (
    intersect_regexes,
    literal_text,
    regex_fsm,
    regexes_disjoint,
    subtract_regexes,
    words_except_regex,
)
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.patterns import json_value_regex
from spruce.constrained.schema.schema_context import BOUNDS
from spruce.constrained.schema.schema_normalize import alternatives
from spruce.constrained.schema.schema_scalars import SAFE_CHAR, pattern_regex, string_regex
from spruce.constrained.schema.schema_validator import pattern_search

KEY_UNIT = r'[^"\\\x00-\x1F\x7F-\x9F]'  # one unescaped key character
KEY_ESCAPE = r'\\["\\bfnrt]'  # escapes; no "\/" or "\u": every key has one spelling
MAX_OVERLAPPING_PATTERNS = 4
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated"}
_OBJECT_KEYS = ("properties", "patternProperties", "additionalProperties", "required", "forbidden",
                "propertyNames", "minProperties", "maxProperties")  # fmt: skip


def object_regex(builder, flat: dict, refs: tuple) -> str | None:
    if not any(k in flat for k in _OBJECT_KEYS):
        return builder.free("object")
    for key in ("minProperties", "maxProperties"):
        if flat.get(key) and not builder.ctx.keeps(BOUNDS, flat["path"], key):
            flat = {k: v for k, v in flat.items() if k != key}
    entries = _declared_entries(builder, flat, refs)
    if entries is None:
        return None
    extra = _extra_entry(builder, flat, refs)
    ws = builder.ws
    low, high = flat.get("minProperties", 0), flat.get("maxProperties")
    options = builder.ctx.options
    if 0 < len(entries) <= options.any_order_max and extra is None and (low, high) == (0, None):
        body = _any_order(entries, f"{ws},{ws}", started=False)
    elif (low, high) == (0, None) or (low <= sum(r for _, _, r in entries) and high is None):
        body = _in_order(entries, extra, f"{ws},{ws}")
    else:
        body = _counted(entries, extra, low, high, f"{ws},{ws}")
    if body is None:
        return None
    builder.orders.append(tuple(name for name, _, _ in entries))
    return rf"\{{{ws}{body}{ws}\}}"


# -- declared properties ------------------------------------------------------------------------


def _declared_entries(builder, flat: dict, refs: tuple) -> list[tuple[str, str, bool]] | None:
    """(name, entry regex, required) in output order; None when a required one cannot be."""
    properties = flat.get("properties", {})
    required = flat.get("required", [])
    forbidden = set(flat.get("forbidden", []))
    names = [n for n in properties if n not in forbidden]
    names += [n for n in required if n not in properties]
    if builder.ctx.options.property_order == "required_first":
        names = [n for n in names if n in required] + [n for n in names if n not in required]
    ws, entries = builder.ws, []
    for name in names:
        schemas = _schemas_for(builder, flat, name)
        value = None
        if schemas is not None and _name_allowed(builder, flat, name):
            value = builder.all_of(schemas or [True], f"{flat['path']}/properties/{name}", refs)
        if value is None:
            if name in required:
                return None
            continue
        key = literal_text(json.dumps(name, ensure_ascii=False))
        entries.append((name, f"{key}{ws}:{ws}{value}", name in required))
    if forbidden & set(required):
        return None
    return entries


def _schemas_for(builder, flat: dict, name: str) -> list | None:
    """Every schema a property's value must satisfy; None when the name is not allowed."""
    schemas = list(flat.get("properties", {}).get(name, []))
    matched = False
    for pattern, pattern_schemas in flat.get("patternProperties", {}).items():
        if _search(builder, flat, pattern, name):
            schemas += pattern_schemas
            matched = True
    if name not in flat.get("properties", {}) and not matched:
        extra = flat.get("additionalProperties", [])
        if False in extra:
            return None
        schemas += extra
    return schemas


def _name_allowed(builder, flat: dict, name: str) -> bool:
    return builder.accepts(flat.get("propertyNames", []), name)


def _search(builder, flat: dict, pattern: str, name: str) -> bool:
    try:
        return pattern_search(pattern, name)
    except ConstraintError:  # a pattern the linear-time engine cannot take
        builder.ctx.skip(
            "patternProperties", flat["path"], f"the regex {pattern!r} is not supported"
        )
        return False


# -- extra properties ---------------------------------------------------------------------------


def _extra_entry(builder, flat: dict, refs: tuple) -> str | None:
    """Regex for one extra `"key":value` entry; None when no extra property is allowed."""
    ctx, path, ws = builder.ctx, flat["path"], builder.ws
    excluded = [*flat.get("properties", {}), *flat.get("required", []), *flat.get("forbidden", [])]
    names_regex = _property_names_regex(builder, flat)
    if names_regex == "":
        return None
    patterns = {}
    for pattern, schemas in flat.get("patternProperties", {}).items():
        regex = pattern_regex(pattern, f"{path}/patternProperties", ctx)
        if regex is not None:
            patterns[regex] = schemas
    options = []
    for key_regex, schemas in _pattern_regions(builder, flat, patterns):
        key = _key_regex(key_regex, excluded, names_regex)
        value = builder.all_of(schemas, f"{path}/patternProperties", refs) if key else None
        if key and value:
            options.append(f'"{key}"{ws}:{ws}{value}')
    extra = flat.get("additionalProperties", [] if builder.ctx.options.open_objects else [False])
    if False not in extra:
        plain = _plain_key_regex(excluded, list(patterns), names_regex)
        schemas = [
            s
            for s in extra
            if s is not True and not (isinstance(s, dict) and set(s) <= _ANNOTATIONS)
        ]
        free = json_value_regex(
            max(builder.ctx.options.any_json_depth - 1, 0)
        )  # nested: one level less
        value = builder.all_of(schemas, f"{path}/additionalProperties", refs) if schemas else free
        if plain and value:
            options.append(f'"{plain}"{ws}:{ws}{value}')
    return (
        None
        if not options
        else options[0]
        if len(options) == 1
        else "(?:" + "|".join(options) + ")"
    )


def _pattern_regions(builder, flat: dict, patterns: dict) -> list[tuple[str, list]]:
    """(key regex, schemas) for each set of patterns a key can match together."""
    regexes = list(patterns)
    if all(regexes_disjoint(a, b) for a, b in combinations(regexes, 2)):
        return [(r, patterns[r]) for r in regexes]
    if len(regexes) > MAX_OVERLAPPING_PATTERNS:
        builder.ctx.skip(
            "patternProperties",
            flat["path"],
            f"more than {MAX_OVERLAPPING_PATTERNS} overlapping patterns",
        )
        return []
    regions = []
    for size in range(1, len(regexes) + 1):
        for chosen in combinations(regexes, size):
            inside = intersect_regexes(list(chosen))
            outside = [r for r in regexes if r not in chosen]
            region = inside if inside is None else subtract_regexes(inside, outside)
            if region is not None:
                regions.append((region, [s for r in chosen for s in patterns[r]]))
    return regions


def _key_regex(key_regex: str, excluded: list[str], names_regex: str | None) -> str | None:
    """A pattern key region without the declared names, within propertyNames."""
    key_fsm = regex_fsm(key_regex)  # an automaton: linear in the name, whatever the pattern
    words = [literal_text(n) for n in excluded if key_fsm.accepts(n)]
    regex = subtract_regexes(key_regex, words) if words else key_regex
    if regex is not None and names_regex is not None:
        regex = intersect_regexes([regex, names_regex])
    return regex


def _plain_key_regex(
    excluded: list[str], patterns: list[str], names_regex: str | None
) -> str | None:
    """Keys matching no pattern and no declared name."""
    if not patterns and names_regex is None:
        words = [_units(n) for n in excluded]
        return words_except_regex(KEY_UNIT, KEY_ESCAPE, [w for w in words if w is not None])
    regex = subtract_regexes(f"{SAFE_CHAR}*", patterns + [literal_text(n) for n in excluded])
    if regex is not None and names_regex is not None:
        regex = intersect_regexes([regex, names_regex])
    return regex


def _units(name: str) -> list[str] | None:
    """The JSON spelling of a name as key units; None when a key regex cannot spell it."""
    text, units, i = json.dumps(name, ensure_ascii=False)[1:-1], [], 0
    while i < len(text):
        step = 2 if text[i] == "\\" else 1
        unit = text[i : i + step]
        if unit.startswith("\\u") or (step == 1 and not re.fullmatch(KEY_UNIT, unit)):
            return None
        units.append(unit)
        i += step
    return units


def _property_names_regex(builder, flat: dict) -> str | None:
    """The key regex (no quotes) of propertyNames; None when there is no propertyNames."""
    schemas = flat.get("propertyNames", [])
    if not schemas:
        return None
    parts = []
    for alt in alternatives(
        {"allOf": [*schemas, {"type": "string"}]}, f"{flat['path']}/propertyNames", builder.ctx
    ):
        if "enum" in alt:
            parts += [
                literal_text(v)
                for v in alt["enum"]
                if isinstance(v, str) and builder.accepts(schemas, v)
            ]
        else:
            regex = string_regex(alt, builder.ctx)
            parts += [] if regex is None else [regex[1:-1]]
    return "(?:" + "|".join(parts) + ")" if parts else ""  # "": no name is allowed


# -- the sequence of entries --------------------------------------------------------------------


def _in_order(entries: list, extra: str | None, comma: str) -> str | None:
    """Linear in the entries: before the first required one, optional entries are written as
    F_i = F_{i-1}(,e_i)? | e_i (the non-empty ordered subsets)."""
    first_required = next((i for i, (_, _, r) in enumerate(entries) if r), None)
    if first_required is None:
        subsets = _nonempty_subsets([e for _, e, _ in entries], extra, comma)
        return "" if subsets is None else f"(?:{subsets})?"
    before = _nonempty_subsets([e for _, e, _ in entries[:first_required]], None, comma)
    out = f"(?:{before}{comma})?" if before else ""
    out += entries[first_required][1]
    for _, entry, required in entries[first_required + 1 :]:
        out += f"{comma}{entry}" if required else f"(?:{comma}{entry})?"
    return out + (f"(?:{comma}{extra})*" if extra else "")


def _nonempty_subsets(entries: list[str], extra: str | None, comma: str) -> str | None:
    subsets = None
    for entry in entries:
        subsets = entry if subsets is None else f"(?:{subsets}(?:{comma}{entry})?|{entry})"
    if extra is not None:
        repeated = f"{extra}(?:{comma}{extra})*"
        subsets = repeated if subsets is None else f"(?:{subsets}(?:{comma}{extra})*|{repeated})"
    return subsets


def _any_order(entries: list, comma: str, started: bool) -> str:
    """Every order of the entries (all required ones present): n! paths, so small n only."""
    options = [] if any(r for _, _, r in entries) else [""]
    for i, (_, entry, _) in enumerate(entries):
        rest = _any_order(entries[:i] + entries[i + 1 :], comma, True)
        options.append(f"{comma if started else ''}{entry}{rest}")
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


def _counted(
    entries: list, extra: str | None, low: int, high: int | None, comma: str
) -> str | None:
    """In order, with the number of entries in [low, high] (extras included)."""
    cap = max(low, 1) if high is None else high + 1
    memo: dict = {}

    def rest(i: int, count: int) -> str | None:
        key = (i, min(count, cap))
        if key not in memo:
            memo[key] = _counted_step(entries, extra, low, high, comma, i, min(count, cap), rest)
        return memo[key]

    return rest(0, 0)


def _counted_step(entries, extra, low, high, comma, i, count, rest) -> str | None:
    if high is not None and count > high:
        return None
    sep = comma if count else ""
    if i == len(entries):
        return _extras_counted(
            extra, max(low - count, 0), None if high is None else high - count, sep, comma
        )
    _, entry, required = entries[i]
    after = rest(i + 1, count + 1)
    take = None if after is None else f"{sep}{entry}{after}"
    if required:
        return take
    skip = rest(i + 1, count)
    if take is None or skip is None:
        return take if skip is None else skip
    return f"(?:{take}|{skip})"


def _extras_counted(
    extra: str | None, need: int, most: int | None, sep: str, comma: str
) -> str | None:
    if extra is None or most == 0:
        return "" if need == 0 else None
    more = f"(?:{comma}{extra})"
    if sep:
        return more + (
            "*" if (need, most) == (0, None) else f"{{{need},{'' if most is None else most}}}"
        )
    tail = f"{more}{{{max(need - 1, 0)},{'' if most is None else most - 1}}}"
    return f"{extra}{tail}" if need else f"(?:{extra}{tail})?"
