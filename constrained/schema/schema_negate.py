"""`not` in its common forms, as flat alternatives (see schema_normalize), and the
disjointness test that makes `oneOf` exact when its branches cannot overlap.

not(A and B) = not A or not B, keyword by keyword; a keyword that applies to one type only
(required: objects) is also satisfied by every other type. Forms with no flat negation
(properties, patterns, items, ...) return None: the caller reports them."""

from __future__ import annotations

from typing import Any

from spruce.constrained.automaton.automata import regexes_disjoint
from spruce.constrained.schema.schema_context import Context
from spruce.constrained.schema.schema_merge import FLATS_KEY, combine, same_json
from spruce.constrained.schema.schema_merge import KINDS as _ANY
from spruce.constrained.schema.schema_refs import resolve_ref
from spruce.constrained.schema.schema_scalars import narrow_classes, pattern_search_regex

_OBJECT, _ARRAY, _STRING = {"object"}, {"array"}, {"string"}
_NUMBER = {"integer", "fraction"}
_TYPE_KINDS = {
    "null": {"null"}, "boolean": {"boolean"}, "object": _OBJECT, "array": _ARRAY,
    "string": _STRING, "integer": {"integer"}, "number": _NUMBER,
}  # fmt: skip
_COUNTS = {  # keyword -> (kinds it applies to, the opposite keyword, +1 or -1)
    "minLength": (_STRING, "maxLength", -1), "maxLength": (_STRING, "minLength", +1),
    "minItems": (_ARRAY, "maxItems", -1), "maxItems": (_ARRAY, "minItems", +1),
    "minProperties": (_OBJECT, "maxProperties", -1), "maxProperties": (_OBJECT, "minProperties", +1),
}  # fmt: skip
_ANNOTATION_KEYS = {
    "title",
    "description",
    "$comment",
    "default",
    "examples",
    "deprecated",
    "$id",
    "$schema",
}


def negate(schema: Any, path: str, ctx: Context, refs: tuple) -> list[dict] | None:
    """Flat alternatives for "not schema"; None when it has no flat form."""
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [{"path": path}]
    if not isinstance(schema, dict):
        return None
    out: list[dict] = []
    for key, value in schema.items():
        if key in _ANNOTATION_KEYS:
            continue
        if key == "$ref":
            target = resolve_ref(value, path, ctx)
            if target is None or value in refs:
                return None
            negated = negate(target, path, ctx, (*refs, value))
        elif key == "anyOf" and isinstance(value, list):
            parts = [negate(branch, path, ctx, refs) for branch in value]
            negated = None if any(p is None for p in parts) else combine(parts, path, ctx)
        elif key == "allOf" and isinstance(value, list):
            parts = [negate(branch, path, ctx, refs) for branch in value]
            negated = None if any(p is None for p in parts) else [f for p in parts for f in p]
        elif key == "properties" and isinstance(value, dict):
            negated = _negate_properties(value, path, ctx, refs)
        else:
            negated = _negate_keyword(key, value, schema, path)
        if negated is None:
            return None
        out.extend(negated)
    return out


def _negate_properties(properties: dict, path: str, ctx: Context, refs: tuple) -> list[dict] | None:
    """not (each present property fits its schema): some property is present and does not."""
    out = []
    for name, sub in properties.items():
        negated = negate(sub, f"{path}/properties/{name}", ctx, refs)
        if negated is None:
            return None
        if negated:
            flats_node = {FLATS_KEY: negated}
            out.append(
                {
                    "path": path,
                    "types": set(_OBJECT),
                    "required": [name],
                    "properties": {name: [flats_node]},
                }
            )
    return out


def _negate_keyword(key: str, value: Any, schema: dict, path: str) -> list[dict] | None:
    if key == "type":
        names = value if isinstance(value, list) else [value]
        if not all(n in _TYPE_KINDS for n in names):
            return None
        kinds = set().union(*(_TYPE_KINDS[n] for n in names))
        return [{"path": path, "types": set(_ANY - kinds)}]
    if key == "required" and isinstance(value, list):
        others = {"path": path, "types": set(_ANY - _OBJECT)}
        return [others] + [{"path": path, "types": set(_OBJECT), "forbidden": [n]} for n in value]
    if key in ("enum", "const"):
        values = value if key == "enum" else [value]
        if not isinstance(values, list) or any(isinstance(v, (dict, list)) for v in values):
            return None
        return [{"path": path, "not_values": list(values)}]
    if key in _COUNTS and isinstance(value, int) and not isinstance(value, bool):
        kinds, opposite, step = _COUNTS[key]
        flat = {"path": path, "types": set(kinds), opposite: value + step}
        if flat[opposite] < 0:
            flat = None
        return [{"path": path, "types": set(_ANY - kinds)}] + ([flat] if flat else [])
    if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return _negate_bound(key, value, schema, path)
    return None


def _negate_bound(key: str, value: Any, schema: dict, path: str) -> list[dict] | None:
    if isinstance(value, bool):
        return [] if key.startswith("exclusive") else None  # draft-4 flag: negated with its bound
    if not isinstance(value, (int, float)):
        return None
    exclusive = (
        key.startswith("exclusive") or schema.get("exclusive" + key[0].upper() + key[1:]) is True
    )
    side = "high" if "inimum" in key else "low"  # not (x >= m) is x < m
    return [
        {"path": path, "types": set(_ANY - _NUMBER)},
        {"path": path, "types": set(_NUMBER), side: (value, not exclusive)},
    ]


# -- disjointness -------------------------------------------------------------------------------


def disjoint(a: dict, b: dict) -> bool:
    """Whether no JSON value satisfies both flat schemas (False when unsure)."""
    kinds = (a.get("types") or _ANY) & (b.get("types") or _ANY)
    if not kinds:
        return True
    if "enum" in a and "enum" in b:
        return not any(same_json(x, y) for x in a["enum"] for y in b["enum"])
    return all(_disjoint_for_kind(kind, a, b) for kind in kinds)


def _disjoint_for_kind(kind: str, a: dict, b: dict) -> bool:
    if kind == "object":
        return _objects_disjoint(a, b) or _objects_disjoint(b, a)
    if kind == "string":
        return _strings_disjoint(a, b)
    if kind in ("integer", "fraction"):
        return _ranges_disjoint(a, b) or _ranges_disjoint(b, a)
    return False


def _objects_disjoint(a: dict, b: dict) -> bool:
    """a requires a name b forbids, or both require a name whose const values differ."""
    for name in a.get("required", []):
        if name in b.get("forbidden", []):
            return True
        if _closed(b) and name not in b.get("properties", {}):
            return True
        if name in b.get("required", []) and _values_differ(a, b, name):
            return True
    return False


def _closed(flat: dict) -> bool:
    return False in flat.get("additionalProperties", []) and not flat.get("patternProperties")


def _values_differ(a: dict, b: dict, name: str) -> bool:
    first, second = _literals(a, name), _literals(b, name)
    if first is None or second is None:
        return False
    return not any(same_json(x, y) for x in first for y in second)


def _literals(flat: dict, name: str) -> list | None:
    """The values a property may take when one of its schemas is a const / enum."""
    for sub in flat.get("properties", {}).get(name, []):
        if isinstance(sub, dict) and "const" in sub:
            return [sub["const"]]
        if isinstance(sub, dict) and isinstance(sub.get("enum"), list):
            return sub["enum"]
    return None


def _strings_disjoint(a: dict, b: dict) -> bool:
    first, second = a.get("patterns", []), b.get("patterns", [])
    if not first or not second or a.get("formats") or b.get("formats"):
        return False
    try:
        return regexes_disjoint(_full(first[0][0]), _full(second[0][0]))
    except Exception:  # noqa: BLE001 - an unsupported pattern: unsure
        return False


def _full(pattern: str) -> str:
    return narrow_classes(pattern_search_regex(pattern))


def _ranges_disjoint(a: dict, b: dict) -> bool:
    """a lies entirely below b."""
    high, low = a.get("high"), b.get("low")
    if high is None or low is None:
        return False
    return high[0] < low[0] or (high[0] == low[0] and (high[1] or low[1]))
