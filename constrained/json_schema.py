"""JSON schema -> regex, through outlines-core's `build_regex_from_schema`.

outlines-core silently drops or mistranslates several keywords (minimum / maximum, allOf
concatenates objects, pattern and format are ignored next to maxLength, its email / uri /
time / date regexes can produce invalid JSON or invalid dates, a recursive required property
is skipped). So the schema is first normalized here:

- every keyword is checked against what can be enforced; anything else is a ConstraintError
  that names it (better refused than silently unenforced);
- allOf is merged into one schema, `type` lists become anyOf, annotations are dropped;
- subschemas outlines-core cannot express (bounded numbers, string formats, patterns) or
  expresses too expensively (any JSON value: its depth-3 regex takes minutes to index)
  become `{"const": "<placeholder>"}`, their regex spliced into outlines-core's output.

Known gap: oneOf is treated as anyOf (overlapping branches are not excluded).
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

import outlines_core

from spruce.constrained.jump_forward import CharAutomaton
from spruce.constrained.limits import (
    MAX_ARRAY_ITEMS,
    MAX_STRING_LENGTH,
    check_regex_size,
    parse_regex,
)
from spruce.constrained.patterns import (
    ANY_JSON_DEPTH,
    JSON_INTEGER,
    JSON_NUMBER,
    FORMAT_REGEXES,
    json_object_regex,
    json_value_regex,
    strip_anchors,
)
from spruce.constrained.ranges import integer_range_regex, number_range_regex
from spruce.constrained.errors import ConstraintError

_ANNOTATIONS = {
    "title", "description", "default", "examples", "$comment", "$schema", "$id",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
    "discriminator",  # OpenAPI / pydantic: the oneOf branches carry the tag themselves
}  # fmt: skip
_TYPE_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "format"},
    "boolean": set(),
    "null": set(),
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_COMBINATORS = ("$ref", "anyOf", "oneOf", "enum", "const")
_KNOWN = _ANNOTATIONS | {"type", "allOf", *_COMBINATORS} | set().union(*_TYPE_KEYWORDS.values())
_JSON_ESCAPED = frozenset('"\\' + "".join(map(chr, range(0x20))))
_SAFE_DOT = r'[^"\\\x00-\x1F]'
_LOWER = {"minimum": max, "minLength": max, "minItems": max, "exclusiveMinimum": max}
_UPPER = {"maximum": min, "maxLength": min, "maxItems": min, "exclusiveMaximum": min}


def schema_to_regex(schema: Any, whitespace_pattern: str = "") -> str:
    """Regex for the JSON documents valid under `schema`; ConstraintError when the schema
    uses a feature that cannot be enforced."""
    converter = _SchemaConverter(schema)
    normalized = converter.convert()
    try:
        regex = outlines_core.json_schema.build_regex_from_schema(
            json.dumps(normalized), whitespace_pattern
        )
    except Exception as e:  # outlines-core raises ValueError / its own error types
        raise ConstraintError(f"JSON schema not supported: {e}") from None
    for key, hole_regex in converter.holes.items():
        regex = regex.replace(f'"{key}"', f"(?:{hole_regex})")
    check_regex_size(regex)
    return regex


def load_schema(value: Any) -> Any:
    """A dict, a JSON string or a pydantic model class -> the schema as JSON data."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return value.model_json_schema()
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
    if isinstance(value, (dict, bool)):
        return value
    raise ConstraintError(
        "json_schema must be a dict, a JSON string or a pydantic model class; "
        f"got {type(value).__name__}"
    )


class _SchemaConverter:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.holes: dict[str, str] = {}
        self._nonce = secrets.token_hex(6)
        self._checked_refs: set[str] = set()

    def convert(self) -> dict:
        out = self.node(self.root, "#")
        if isinstance(self.root, dict):
            for key in ("$defs", "definitions"):
                defs = self.root.get(key)
                if isinstance(defs, dict):
                    out[key] = {n: self.node(s, f"#/{key}/{n}") for n, s in defs.items()}
            if "$id" in self.root:
                out["$id"] = self.root["$id"]
        return out

    def node(self, schema: Any, path: str) -> dict:
        if schema is True:
            return self._hole(json_value_regex())
        if not isinstance(schema, dict):
            raise ConstraintError(f"{path}: a schema must be an object (got {json.dumps(schema)})")
        unknown = [k for k in schema if k not in _KNOWN]
        if unknown:
            raise ConstraintError(f"unsupported JSON schema feature {unknown[0]!r} at {path}")
        if "allOf" in schema:
            return self.node(self._merge_all_of(schema, path), path)
        used = [k for k in _COMBINATORS if k in schema]
        if len(used) > 1:
            raise ConstraintError(
                f"combining {used[0]!r} and {used[1]!r} in one schema is not supported ({path})"
            )
        if used:
            handler = {
                "$ref": self._ref, "anyOf": self._any_of, "oneOf": self._one_of,
                "enum": self._enum, "const": self._const,
            }[used[0]]  # fmt: skip
            return handler(schema, path)
        return self._typed(schema, path)

    # -- combinators --------------------------------------------------------------------

    def _ref(self, schema: dict, path: str) -> dict:
        extra = _constraints(schema) - {"$ref"}
        if extra:
            raise ConstraintError(
                f"keywords next to $ref are not supported ({sorted(extra)} at {path})"
            )
        ref = schema["$ref"]
        self._check_ref(ref, [])
        return {"$ref": ref}

    def _any_of(self, schema: dict, path: str, key: str = "anyOf") -> dict:
        extra = _constraints(schema) - {key}
        if extra:
            raise ConstraintError(f"{key} together with {sorted(extra)} is not supported ({path})")
        branches = schema[key]
        if not isinstance(branches, list) or not branches:
            raise ConstraintError(f"{key} must be a non-empty list ({path})")
        return {"anyOf": [self.node(b, f"{path}/{key}/{i}") for i, b in enumerate(branches)]}

    def _one_of(self, schema: dict, path: str) -> dict:
        return self._any_of(schema, path, "oneOf")

    def _enum(self, schema: dict, path: str) -> dict:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise ConstraintError(f"enum must be a non-empty list ({path})")
        return {"enum": [self._scalar(v, schema, path, "enum") for v in values]}

    def _const(self, schema: dict, path: str) -> dict:
        return {"const": self._scalar(schema["const"], schema, path, "const")}

    def _scalar(self, value: Any, schema: dict, path: str, keyword: str) -> Any:
        if isinstance(value, (dict, list)):
            raise ConstraintError(f"{keyword} with object / array values is not supported ({path})")
        types = schema.get("type")
        if types is not None and not _is_of_type(value, types):
            raise ConstraintError(
                f"{keyword} value {json.dumps(value)} is not of type {types} ({path})"
            )
        return value

    # -- types ----------------------------------------------------------------------------

    def _typed(self, schema: dict, path: str) -> dict:
        types = schema.get("type", _implied_type(schema))
        if types is None:
            constraints = _constraints(schema) - {"type"}
            if constraints:
                first = sorted(constraints)[0]
                raise ConstraintError(f"{first!r} without a 'type' is not supported ({path})")
            return self._hole(json_value_regex())
        if isinstance(types, list):
            if not types:
                raise ConstraintError(f"'type' must not be an empty list ({path})")
            branches = [self._one_type(t, schema, path) for t in dict.fromkeys(types)]
            return branches[0] if len(branches) == 1 else {"anyOf": branches}
        return self._one_type(types, schema, path)

    def _one_type(self, type_name: Any, schema: dict, path: str) -> dict:
        if type_name not in _TYPE_KEYWORDS:
            raise ConstraintError(f"unknown type {type_name!r} at {path}")
        return getattr(self, f"_{type_name}")(schema, path)

    def _boolean(self, schema: dict, path: str) -> dict:
        return {"type": "boolean"}

    def _null(self, schema: dict, path: str) -> dict:
        return {"type": "null"}

    def _string(self, schema: dict, path: str) -> dict:
        lengths = {k: schema[k] for k in ("minLength", "maxLength") if k in schema}
        special = [k for k in ("pattern", "format") if k in schema]
        if special and (lengths or len(special) > 1):
            both = special + list(lengths)
            raise ConstraintError(
                f"{both[0]!r} together with {both[1]!r} is not supported ({path})"
            )
        if "pattern" in schema:
            return self._hole(f'"(?:{_json_safe_pattern(schema["pattern"], path)})"')
        if "format" in schema:
            fmt = schema["format"]
            if fmt not in FORMAT_REGEXES:
                raise ConstraintError(
                    f"unsupported string format {fmt!r} at {path} "
                    f"(supported: {', '.join(FORMAT_REGEXES)})"
                )
            return self._hole(f'"(?:{FORMAT_REGEXES[fmt]})"')
        for key, value in lengths.items():
            _check_count(value, key, MAX_STRING_LENGTH, path)
        if lengths.get("minLength", 0) > lengths.get("maxLength", math.inf):
            raise ConstraintError(f"minLength > maxLength at {path}")
        return {"type": "string", **lengths}

    def _integer(self, schema: dict, path: str) -> dict:
        low, high = _bounds(schema, path)
        if low is None and high is None:
            return self._hole(JSON_INTEGER)
        low_int = high_int = None
        if low is not None:
            low_int = math.floor(low[0]) + 1 if low[1] else math.ceil(low[0])
        if high is not None:
            high_int = math.ceil(high[0]) - 1 if high[1] else math.floor(high[0])
        if low_int is not None and high_int is not None and low_int > high_int:
            raise ConstraintError(f"no integer lies between the bounds at {path}")
        return self._hole(integer_range_regex(low_int, high_int))

    def _number(self, schema: dict, path: str) -> dict:
        low, high = _bounds(schema, path)
        if low is None and high is None:
            return self._hole(JSON_NUMBER)
        for bound in (low, high):
            if bound is not None and not float(bound[0]).is_integer():
                raise ConstraintError(
                    f"a fractional number bound ({bound[0]}) is not supported ({path})"
                )
        if low is not None and high is not None and (
            low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))
        ):
            raise ConstraintError(f"no number lies between the bounds at {path}")
        return self._hole(
            number_range_regex(
                None if low is None else int(low[0]),
                None if high is None else int(high[0]),
                bool(low and low[1]),
                bool(high and high[1]),
            )
        )

    def _array(self, schema: dict, path: str) -> dict:
        if schema.get("uniqueItems") is True:
            raise ConstraintError(f"unsupported JSON schema feature 'uniqueItems' at {path}")
        out: dict[str, Any] = {"type": "array"}
        items, prefix = schema.get("items"), schema.get("prefixItems")
        if isinstance(items, list):  # draft-4 tuple form
            items, prefix = None, items
        if prefix is not None:
            if not isinstance(prefix, list) or not prefix:
                raise ConstraintError(f"prefixItems must be a non-empty list ({path})")
            exact = schema.get("minItems", 0) <= len(prefix) <= schema.get("maxItems", math.inf)
            if not exact or items not in (None, False):
                raise ConstraintError(
                    f"prefixItems allowing more or fewer items is not supported ({path})"
                )
            return {
                "prefixItems": [
                    self.node(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix)
                ]
            }
        if items is None or _is_any(items):  # nested in the array: one level less
            out["items"] = self._hole(json_value_regex(ANY_JSON_DEPTH - 1))
        else:
            out["items"] = self.node(items, f"{path}/items")
        for key in ("minItems", "maxItems"):
            if key in schema:
                out[key] = _check_count(schema[key], key, MAX_ARRAY_ITEMS, path)
        if out.get("minItems", 0) > out.get("maxItems", math.inf):
            raise ConstraintError(f"minItems > maxItems at {path}")
        return out

    def _object(self, schema: dict, path: str) -> dict:
        properties = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ConstraintError(f"required must be a list of names ({path})")
        if properties is None:
            return self._free_object(schema, required, path)
        if not isinstance(properties, dict):
            raise ConstraintError(f"properties must be an object ({path})")
        missing = [r for r in required if r not in properties]
        if missing:
            raise ConstraintError(f"required property {missing[0]!r} is not in properties ({path})")
        for name in properties:
            if any(c in _JSON_ESCAPED for c in name):
                raise ConstraintError(
                    f"property name {name!r} needs JSON escaping; not supported ({path})"
                )
        return {
            "type": "object",
            "properties": {
                n: self.node(s, f"{path}/properties/{n}") for n, s in properties.items()
            },
            "required": [r for r in properties if r in required],
        }

    def _free_object(self, schema: dict, required: list, path: str) -> dict:
        if required:
            raise ConstraintError(f"required without properties is not supported ({path})")
        extra = schema.get("additionalProperties", True)
        if extra is False:
            return {"type": "object", "properties": {}}
        if _is_any(extra):  # nested in the object: one level less
            return self._hole(json_object_regex(json_value_regex(ANY_JSON_DEPTH - 1)))
        values = self.node(extra, f"{path}/additionalProperties")
        return {"type": "object", "additionalProperties": values}

    # -- helpers --------------------------------------------------------------------------

    def _hole(self, regex: str) -> dict:
        key = f"spruce_{self._nonce}_{len(self.holes)}"
        self.holes[key] = regex
        return {"const": key}

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            raise ConstraintError(f"only local $ref to '#/$defs/...' is supported (got {ref!r})")
        target = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise ConstraintError(f"$ref {ref!r} does not resolve")
            target = target[part]
        return target

    def _check_ref(self, ref: str, stack: list[str]) -> None:
        if ref in stack:
            raise ConstraintError(
                f"recursive schemas are not supported ($ref cycle through {ref!r})"
            )
        if ref in self._checked_refs:
            return
        target = self._resolve(ref)
        for inner in _refs_in(target):
            self._check_ref(inner, [*stack, ref])
        self._checked_refs.add(ref)

    def _merge_all_of(self, schema: dict, path: str) -> dict:
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise ConstraintError(f"allOf must be a non-empty list ({path})")
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in parts:
            if isinstance(part, dict) and "$ref" in part:
                self._check_ref(part["$ref"], [])
                part = self._resolve(part["$ref"])
            if part is True:
                continue
            if not isinstance(part, dict):
                raise ConstraintError(f"allOf members must be schemas ({path})")
            if "allOf" in part:
                part = self._merge_all_of(part, path)
            merged = _merge(merged, part, path)
        return merged


def _merge(a: dict, b: dict, path: str) -> dict:
    out = dict(a)
    for key, value in b.items():
        if key in _ANNOTATIONS:
            continue
        if key not in out:
            out[key] = value
        elif key == "properties":
            props = dict(out[key])
            for name, sub in value.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            out[key] = props
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key == "type":
            out[key] = _intersect_types(out[key], value, path)
        elif key in _LOWER or key in _UPPER:
            out[key] = (_LOWER.get(key) or _UPPER[key])(out[key], value)
        elif out[key] != value:
            raise ConstraintError(
                f"allOf with conflicting {key!r} values is not supported ({path})"
            )
    return out


def _intersect_types(a: Any, b: Any, path: str) -> Any:
    a_set = set(a if isinstance(a, list) else [a])
    b_set = set(b if isinstance(b, list) else [b])
    for s, other in ((a_set, b_set), (b_set, a_set)):
        if "number" in s and "integer" in other:
            s.add("integer")
    common = [t for t in _TYPE_KEYWORDS if t in a_set & b_set]
    if not common:
        raise ConstraintError(f"allOf members have no type in common ({path})")
    return common[0] if len(common) == 1 else common


def _bounds(schema: dict, path: str) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """(value, exclusive) of the tightest lower and upper bound."""
    found = {}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:
            value = schema[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConstraintError(f"{key} must be a number at {path} (got {json.dumps(value)})")
            found[key] = value
    low = _tighter(found.get("minimum"), found.get("exclusiveMinimum"), lower=True)
    high = _tighter(found.get("maximum"), found.get("exclusiveMaximum"), lower=False)
    return low, high


def _tighter(
    inclusive: float | None, exclusive: float | None, lower: bool
) -> tuple[float, bool] | None:
    if exclusive is None:
        return None if inclusive is None else (inclusive, False)
    if inclusive is None:
        return (exclusive, True)
    if lower:
        return (exclusive, True) if exclusive >= inclusive else (inclusive, False)
    return (exclusive, True) if exclusive <= inclusive else (inclusive, False)


def _check_count(value: Any, key: str, cap: int, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConstraintError(f"{key} must be a non-negative integer at {path}")
    if value > cap:
        raise ConstraintError(
            f"{key} {value} at {path} is above the cap of {cap}: every bounded position grows the "
            f"token index (~0.5 MB and 4 ms per string character with a 49k vocabulary); lower it "
            f"or drop it"
        )
    return value


def _is_any(schema: Any) -> bool:
    return schema is True or (isinstance(schema, dict) and not _constraints(schema))


def _constraints(schema: dict) -> set[str]:
    return {k for k in schema if k not in _ANNOTATIONS}


def _implied_type(schema: dict) -> str | None:
    if any(k in schema for k in _TYPE_KEYWORDS["object"]):
        return "object"
    if any(k in schema for k in _TYPE_KEYWORDS["array"]):
        return "array"
    return None


def _is_of_type(value: Any, types: Any) -> bool:
    names = types if isinstance(types, list) else [types]
    kind = _json_type(value)
    return kind in names or (kind == "integer" and "number" in names)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "other"


def _refs_in(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        found = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return found + [r for k, v in schema.items() if k != "$ref" for r in _refs_in(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs_in(v)]
    return []


def _json_safe_pattern(pattern: Any, path: str) -> str:
    """The pattern as a full-match regex whose matches need no JSON escaping: '.' and
    negated classes are narrowed to exclude '"', '\\' and control characters; anything else
    that could produce them is refused."""
    if not isinstance(pattern, str):
        raise ConstraintError(f"pattern must be a string at {path}")
    narrowed = _narrow(strip_anchors(pattern))
    parse_regex(narrowed)
    try:
        automaton = CharAutomaton(narrowed)
    except Exception as e:
        raise ConstraintError(f"unsupported pattern {pattern!r} at {path}: {e}") from None
    if automaton.can_emit(_JSON_ESCAPED):
        raise ConstraintError(
            f"pattern {pattern!r} at {path} can produce characters that JSON strings must escape "
            f"('\"', '\\\\', control characters); not supported"
        )
    return narrowed


def _narrow(pattern: str) -> str:
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
            j += pattern.startswith("]", j)  # a leading ']' is a literal
            out.append(pattern[i:j])
            in_class, i = True, j
            continue
        if in_class and char == "]":
            out.append(r'"\\\x00-\x1F]' if negated else "]")
            in_class = False
        elif not in_class and char == ".":
            out.append(_SAFE_DOT)
        else:
            out.append(char)
        i += 1
    return "".join(out)
