"""Merging flat schemas (see schema_normalize): the intersection of two, and the product of
unions that allOf of anyOf makes."""

from __future__ import annotations

from itertools import product
from typing import Any

from spruce.constrained.core.errors import ConstraintError, TooLarge
from spruce.constrained.schema.schema_context import Context
from spruce.constrained.schema.schema_validator import pattern_search

KINDS = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
MAX_ALTERNATIVES = 256
FLATS_KEY = "$spruce_flats"  # an internal schema node holding ready alternatives


def combine(parts: list[list[dict]], path: str, ctx: Context) -> list[dict]:
    """allOf of unions: the product of the alternatives, each tuple merged."""
    out = [{"path": path}]
    for part in parts:
        size = len(out) * len(part)
        if size > MAX_ALTERNATIVES:
            raise TooLarge(
                f"schema too large at {path}: its anyOf / oneOf / allOf / if branches multiply "
                f"out to {size} alternatives (cap {MAX_ALTERNATIVES})"
            )
        merged = (merge(a, b, ctx) for a, b in product(out, part))
        out = [m for m in merged if m is not None]
    return out


def tighten(flat: dict, side: str, bound: tuple) -> None:
    old = flat.get(side)
    if old is None:
        flat[side] = bound
        return
    value, exclusive = bound
    if side == "low":
        better = value > old[0] or (value == old[0] and exclusive)
    else:
        better = value < old[0] or (value == old[0] and exclusive)
    if better:
        flat[side] = bound


_LOWER = ("minLength", "minItems", "minProperties")
_UPPER = ("maxLength", "maxItems", "maxProperties")
_CONCAT = ("patterns", "formats", "multipleOf", "not_values", "propertyNames")


def merge(a: dict, b: dict, ctx: Context) -> dict | None:
    """The intersection of two flat schemas; None when provably empty."""
    out = dict(a)
    for key, value in b.items():
        if key == "path" or key not in out:
            if key != "path":
                out[key] = value
            continue
        if key == "refs":
            out[key] = max(out[key], value, key=len)
        elif key == "types":
            out[key] = out[key] & value
        elif key == "enum":
            out[key] = [v for v in out[key] if any(same_json(v, w) for w in value)]
        elif key in _LOWER:
            out[key] = max(out[key], value)
        elif key in _UPPER:
            out[key] = min(out[key], value)
        elif key in ("low", "high"):
            tighten(out, key, value)
        elif key in _CONCAT or key in ("items", "additionalProperties"):
            out[key] = out[key] + value
        elif key in ("required", "forbidden"):
            out[key] = list(dict.fromkeys(out[key] + value))
        elif key == "prefixItems":
            out[key] = _merge_prefix(a, b)
    if _has_object_maps(a) and _has_object_maps(b):
        _merge_object_maps(out, a, b, ctx)
    if "prefixItems" in out and ("prefixItems" in a) != ("prefixItems" in b):
        out["prefixItems"] = _merge_prefix(a, b)
    return _pruned(out)


def _has_object_maps(flat: dict) -> bool:
    return any(k in flat for k in ("properties", "patternProperties", "additionalProperties"))


def _merge_prefix(a: dict, b: dict) -> list:
    length = max(len(a.get("prefixItems", [])), len(b.get("prefixItems", [])))
    return [_item_at(a, i) + _item_at(b, i) for i in range(length)]


def _item_at(flat: dict, i: int) -> list:
    prefix = flat.get("prefixItems", [])
    return prefix[i] if i < len(prefix) else flat.get("items", [])


def _merge_object_maps(out: dict, a: dict, b: dict, ctx: Context) -> None:
    """Each side's additionalProperties covers only the names it does not declare."""
    names = list(dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]))
    out["properties"] = {
        n: _schemas_for_name(a, n, ctx) + _schemas_for_name(b, n, ctx) for n in names
    }
    patterns_a, patterns_b = a.get("patternProperties", {}), b.get("patternProperties", {})
    if (
        patterns_a
        and patterns_b
        and (a.get("additionalProperties") or b.get("additionalProperties"))
    ):
        ctx.skip("patternProperties", a["path"], "allOf parts that both have patternProperties")
    merged = {
        p: s + ([] if patterns_b else b.get("additionalProperties", []))
        for p, s in patterns_a.items()
    }
    for p, s in patterns_b.items():
        merged[p] = (
            merged.get(p, []) + s + ([] if patterns_a else a.get("additionalProperties", []))
        )
    if merged:
        out["patternProperties"] = merged
    extra = a.get("additionalProperties", []) + b.get("additionalProperties", [])
    if extra:
        out["additionalProperties"] = extra


def _schemas_for_name(flat: dict, name: str, ctx: Context) -> list:
    if name in flat.get("properties", {}):
        return flat["properties"][name]
    patterns = flat.get("patternProperties", {})
    matching = [p for p in patterns if _search(p, name, flat, ctx)]
    if matching:
        return [s for p in matching for s in patterns[p]]
    return flat.get("additionalProperties", [])


def _search(pattern: str, name: str, flat: dict, ctx: Context) -> bool:
    try:
        return pattern_search(pattern, name)
    except ConstraintError:  # a pattern the linear-time engine cannot take
        ctx.skip("patternProperties", flat["path"], f"the regex {pattern!r} is not supported")
        return False


def _pruned(flat: dict) -> dict | None:
    """None when no value fits; objects dropped when a name is both required and forbidden."""
    if set(flat.get("required", [])) & set(flat.get("forbidden", [])):
        flat["types"] = (KINDS if flat.get("types") is None else flat["types"]) - {"object"}
    if flat.get("types") is not None and not flat["types"]:
        return None
    if "enum" in flat and not flat["enum"]:
        return None
    return flat


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return (type(a) in (int, float) and type(b) in (int, float) and a == b) or (
        type(a) is type(b) and a == b
    )
