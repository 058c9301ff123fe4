"""JSON schema -> alternatives: a list of "flat" schemas whose union is the schema.

A flat schema is a dict of plain constraints (no $ref, allOf, anyOf, oneOf, not, if):
    path, types (set of kinds, None = any), enum (list), not_values, minLength, maxLength,
    patterns [(pattern, path)], formats [(name, path)], low / high ((value, exclusive)),
    multipleOf [(value, path)], prefixItems [[schema, ...]], items [schema, ...],
    minItems, maxItems, properties {name: [schema, ...]}, patternProperties
    {pattern: [schema, ...]}, additionalProperties [schema, ...], required [...],
    forbidden [...], propertyNames [schema, ...], minProperties, maxProperties.
A list of schemas means all of them (allOf); subschemas stay raw until emitted, so a
recursive $ref is unrolled one container at a time.

$ref is resolved (siblings apply too), allOf parts are merged, anyOf / oneOf are distributed
over their siblings, `not` and `if` are rewritten where the negation has a flat form, and
dependencies become alternatives. Unknown keywords are annotations: ignored.
"""

from __future__ import annotations

from typing import Any

from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.schema.schema_context import Context
from spruce.constrained.schema.schema_merge import FLATS_KEY, combine, merge, same_json, tighten
from spruce.constrained.schema.schema_negate import disjoint, negate
from spruce.constrained.schema.schema_refs import resolve_ref

TYPE_KINDS = {
    "null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
    "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"},
}  # fmt: skip
MAX_CONDITIONAL_ALTERNATIVES = 8
UNENFORCEABLE = ("uniqueItems", "contains", "unevaluatedProperties", "unevaluatedItems",
                 "$dynamicRef", "$recursiveRef")  # fmt: skip


def alternatives(schema: Any, path: str, ctx: Context, refs: tuple = ()) -> list[dict]:
    """The flat alternatives of `schema`; [] when nothing is valid under it."""
    if schema is True or schema == {}:
        return [{"path": path}]
    if schema is False:
        return []
    if not isinstance(schema, dict):
        raise ConstraintError(f"{path}: a schema must be an object or a boolean (got {schema!r})")
    if FLATS_KEY in schema:
        return schema[FLATS_KEY]
    parts = [[{**own_flat(schema, path, ctx), "refs": refs}]]
    if "$ref" in schema:
        parts.append(_ref_alternatives(schema["$ref"], path, ctx, refs))
    for i, part in enumerate(_list(schema, "allOf", path)):
        parts.append(alternatives(part, f"{path}/allOf/{i}", ctx, refs))
    if "anyOf" in schema:
        parts.append(_union(schema, "anyOf", path, ctx, refs))
    if "oneOf" in schema:
        parts.append(_one_of(schema, path, ctx, refs))
    if "not" in schema:
        parts.append(_not(schema["not"], f"{path}/not", ctx, refs))
    conditions = (
        [("if", lambda: [_if_then_else(schema, path, ctx, refs)])] if "if" in schema else []
    )
    conditions.append(("dependentRequired", lambda: _dependencies(schema, path, ctx, refs)))
    for keyword, make in conditions:
        _add_conditions(parts, keyword, make, path, ctx)
    return combine(parts, path, ctx)


def _add_conditions(parts: list, keyword: str, make, path: str, ctx: Context) -> None:
    """Conditions double the alternatives each: past MAX_CONDITIONAL_ALTERNATIVES they are
    left out (reported) instead of multiplying the regex."""
    new = make()
    size = 1
    for part in parts + new:
        size *= max(len(part), 1)
    if size > MAX_CONDITIONAL_ALTERNATIVES:
        ctx.skip(keyword, path, f"its conditions multiply out to {size} alternatives")
        return
    parts.extend(new)


def _ref_alternatives(ref: Any, path: str, ctx: Context, refs: tuple) -> list[dict]:
    target = resolve_ref(ref, path, ctx)
    if target is None:  # unresolvable, reported: any value, and an object it is part of stays open
        return [{"path": path, "additionalProperties": [True]}]
    if refs.count(ref) >= ctx.options.recursion_depth:
        return []  # the deepest level of a recursive schema is closed off
    return alternatives(target, f"{path}/$ref", ctx, (*refs, ref))


def _union(schema: dict, key: str, path: str, ctx: Context, refs: tuple) -> list[dict]:
    out = []
    for i, branch in enumerate(_list(schema, key, path)):
        out.extend(alternatives(branch, f"{path}/{key}/{i}", ctx, refs))
    return out


def _one_of(schema: dict, path: str, ctx: Context, refs: tuple) -> list[dict]:
    """Exact when the branches cannot overlap, or when each branch can be narrowed by the
    negation of the others (A and not B, B and not A); else anyOf, reported."""
    raw = _list(schema, "oneOf", path)
    branches = [alternatives(b, f"{path}/oneOf/{i}", ctx, refs) for i, b in enumerate(raw)]
    own = own_flat(schema, path, ctx)  # siblings narrow the branches before they are compared
    branches = [[m for f in branch if (m := merge(own, f, ctx)) is not None] for branch in branches]
    overlapping = {
        (i, j) for i in range(len(branches)) for j in range(len(branches)) if i != j
        and not all(disjoint(a, b) for a in branches[i] for b in branches[j])
    }  # fmt: skip
    if not overlapping:
        return [f for branch in branches for f in branch]
    out = []
    for i, branch in enumerate(branches):
        parts = [branch]
        for j in sorted(j for a, j in overlapping if a == i):
            negated = negate(raw[j], f"{path}/oneOf/{j}", ctx, refs)
            if negated is None:
                ctx.skip("oneOf", path, "its branches may overlap (treated as anyOf)")
                return [f for branch in branches for f in branch]
            parts.append(negated)
        out.extend(combine(parts, path, ctx))
    return out


def _not(schema: Any, path: str, ctx: Context, refs: tuple) -> list[dict]:
    negated = negate(schema, path, ctx, refs)
    if negated is None:
        ctx.skip("not", path, "only not of type / required / enum / const / bounds and their anyOf")
        return [{"path": path}]
    return negated


def _if_then_else(schema: dict, path: str, ctx: Context, refs: tuple) -> list[dict]:
    condition = schema["if"]
    negated = negate(condition, f"{path}/if", ctx, refs)
    if negated is None:  # then or else holds: their union, a superset, reported
        ctx.skip("if", path, "the if-schema has no flat negation (then / else enforced as anyOf)")
        branches = (("then", schema.get("then", True)), ("else", schema.get("else", True)))
        return [
            f for key, branch in branches for f in alternatives(branch, f"{path}/{key}", ctx, refs)
        ]
    then = combine(
        [alternatives(condition, f"{path}/if", ctx, refs), alternatives(schema.get("then", True), f"{path}/then", ctx, refs)],
        path, ctx,
    )  # fmt: skip
    otherwise = combine(
        [negated, alternatives(schema.get("else", True), f"{path}/else", ctx, refs)], path, ctx
    )
    return then + otherwise


def _dependencies(schema: dict, path: str, ctx: Context, refs: tuple) -> list[list[dict]]:
    """dependentRequired / dependentSchemas (and draft-4 `dependencies`): for each trigger
    property, "absent" or "present with its dependency" (object keywords pass non-objects)."""
    found = {}
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            found.update(schema[key])
    parts = []
    for name, dependency in found.items():
        present = {"path": path, "required": [name]}
        if isinstance(dependency, list):
            needed = [{**present, "required": list(dict.fromkeys([name, *dependency]))}]
        else:
            where = f"{path}/dependentSchemas/{name}"
            needed = combine([[present], alternatives(dependency, where, ctx, refs)], path, ctx)
        parts.append([{"path": path, "forbidden": [name]}, *needed])
    return parts


def _list(schema: dict, key: str, path: str) -> list:
    value = schema.get(key, [])
    if not isinstance(value, list) or (key in schema and not value):
        raise ConstraintError(f"{key} must be a non-empty list ({path})")
    return value


# -- a schema's own keywords --------------------------------------------------------------------


def own_flat(schema: dict, path: str, ctx: Context) -> dict:
    flat: dict[str, Any] = {"path": path}
    _types(schema, flat, path)
    if "enum" in schema:
        if not isinstance(schema["enum"], list):
            raise ConstraintError(f"enum must be a list ({path})")
        flat["enum"] = list(schema["enum"])
    if "const" in schema:
        flat["enum"] = (
            [schema["const"]]
            if "enum" not in flat
            else [v for v in flat["enum"] if same_json(v, schema["const"])]
        )
    _strings(schema, flat, path)
    _numbers(schema, flat, path)
    _arrays(schema, flat, path)
    _objects(schema, flat, path)
    for keyword in UNENFORCEABLE:
        if keyword in schema and schema[keyword] not in (False, None):
            ctx.skip(keyword, path, "no regular grammar expresses it")
    return flat


def _types(schema: dict, flat: dict, path: str) -> None:
    if "type" not in schema:
        return
    names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    kinds: set[str] = set()
    for name in names:
        if name not in TYPE_KINDS:
            raise ConstraintError(f"unknown type {name!r} at {path}")
        kinds |= TYPE_KINDS[name]
    flat["types"] = kinds


def _strings(schema: dict, flat: dict, path: str) -> None:
    for key in ("minLength", "maxLength"):
        if key in schema:
            flat[key] = _count(schema[key], key, path)
    if "pattern" in schema:
        flat["patterns"] = [(schema["pattern"], path)]
    if isinstance(schema.get("format"), str):
        flat["formats"] = [(schema["format"], path)]


def _numbers(schema: dict, flat: dict, path: str) -> None:
    bounds = {
        k: schema[k]
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
        if k in schema
    }
    for key, value in bounds.items():
        if not isinstance(value, (int, float)) or (
            isinstance(value, bool) and key in ("minimum", "maximum")
        ):
            raise ConstraintError(f"{key} must be a number at {path} (got {value!r})")
    for side, inclusive, exclusive in (
        ("low", "minimum", "exclusiveMinimum"),
        ("high", "maximum", "exclusiveMaximum"),
    ):
        found = []
        if inclusive in bounds:
            found.append((bounds[inclusive], bounds.get(exclusive) is True))  # draft-4 boolean
        if exclusive in bounds and not isinstance(bounds[exclusive], bool):
            found.append((bounds[exclusive], True))
        for bound in found:
            tighten(flat, side, bound)
    if "multipleOf" in schema:
        value = schema["multipleOf"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConstraintError(f"multipleOf must be a positive number at {path}")
        flat["multipleOf"] = [(value, path)]


def _arrays(schema: dict, flat: dict, path: str) -> None:
    items, prefix = schema.get("items"), schema.get("prefixItems")
    if isinstance(items, list):  # draft-4 tuple form; additionalItems is the rest
        prefix, items = items, schema.get("additionalItems")
    if prefix is not None:
        flat["prefixItems"] = [[s] for s in prefix]
    if items is not None:
        flat["items"] = [items]
    for key in ("minItems", "maxItems"):
        if key in schema:
            flat[key] = _count(schema[key], key, path)


def _objects(schema: dict, flat: dict, path: str) -> None:
    properties = schema.get("properties")
    if isinstance(properties, dict):
        flat["properties"] = {name: [sub] for name, sub in properties.items()}
    if isinstance(schema.get("patternProperties"), dict):
        flat["patternProperties"] = {p: [sub] for p, sub in schema["patternProperties"].items()}
    if "additionalProperties" in schema:
        flat["additionalProperties"] = [schema["additionalProperties"]]
    required = schema.get("required")
    if isinstance(required, list):  # draft-3 `required: true` in a property is ignored
        if not all(isinstance(r, str) for r in required):
            raise ConstraintError(f"required must be a list of names ({path})")
        flat["required"] = list(dict.fromkeys(required))
    if "propertyNames" in schema:
        flat["propertyNames"] = [schema["propertyNames"]]
    for key in ("minProperties", "maxProperties"):
        if key in schema:
            flat[key] = _count(schema[key], key, path)


def _count(value: Any, key: str, path: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConstraintError(f"{key} must be a non-negative integer at {path}")
    return value
