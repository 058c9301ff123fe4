"""Flat alternatives (schema_normalize) -> one regex of compact JSON text: the builder that
walks the schema, literal values, arrays, and the per-type dispatch."""

from __future__ import annotations

import json
from typing import Any

from spruce.constrained.automaton.automata import literal_text
from spruce.constrained.automaton.limits import MAX_ARRAY_ITEMS
from spruce.constrained.core.errors import ConstraintError, TooLarge
from spruce.constrained.core.patterns import (
    JSON_INTEGER,
    JSON_NUMBER,
    JSON_STRING,
    json_array_regex,
    json_object_regex,
    json_value_regex,
)
from spruce.constrained.schema.schema_context import BOUNDS, LOOSE, STRICT, Context
from spruce.constrained.schema.schema_merge import KINDS, same_json
from spruce.constrained.schema.schema_normalize import TYPE_KINDS, alternatives
from spruce.constrained.schema.schema_objects import object_regex
from spruce.constrained.schema.schema_scalars import integer_regex, number_regex, string_regex
from spruce.constrained.schema.schema_size import Part, subtree_keywords
from spruce.constrained.schema.schema_validator import validator_class

MAX_REGEX_CHARS = 4_000_000  # the regex text built so far; past it the schema is refused
_TYPE_KEYS = {
    "string": ("minLength", "maxLength", "patterns", "formats"),
    "integer": ("low", "high", "multipleOf"),
    "fraction": ("low", "high", "multipleOf"),
    "array": ("prefixItems", "items", "minItems", "maxItems"),
    "object": ("properties", "patternProperties", "additionalProperties", "required", "forbidden",
               "propertyNames", "minProperties", "maxProperties"),
}  # fmt: skip


class RegexBuilder:
    """One per conversion. `orders` records each object's property order as built (for
    `canonical_instance`, which writes an instance the way the grammar expects it)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.ws = ctx.options.whitespace_pattern
        self.orders: list[tuple[str, ...]] = []
        self._size = 0
        self._validator = _validator(ctx.root)
        self._cache: dict[tuple, tuple] = {}  # (id(schema), refs) -> (schema, regex, part)
        self.root_part: Part | None = None  # what each subschema's regex holds (schema_size)
        self._building: list[Part] = []

    def value(self, schema: Any, path: str, refs: tuple = ()) -> str | None:
        """Regex for the values valid under `schema`; None when there is none (a recursion
        closed off, an impossible combination)."""
        key = (id(schema), refs)
        if key in self._cache:
            self._attach(self._cache[key][2])
            return self._cache[key][1]
        part = Part(path)
        self._attach(part)
        self._building.append(part)
        try:
            regex = self._regex(schema, path, refs)
        finally:
            self._building.pop()
        part.regex = regex
        self._cache[key] = (schema, regex, part)  # the schema kept alive: its id stays unique
        self._size += len(regex or "")
        if self._size > MAX_REGEX_CHARS:
            raise RegexTooLong(
                f"schema too large: its regex passes {MAX_REGEX_CHARS} characters at {path} "
                f"(lower recursion_depth / any_json_depth, or simplify that part)"
            )
        return regex

    def _attach(self, part: Part) -> None:
        if self._building:
            self._building[-1].children.append(part)
        elif self.root_part is None:
            self.root_part = part

    def _regex(self, schema: Any, path: str, refs: tuple) -> str | None:
        if self.ctx.relaxed.get(path, 0) >= LOOSE:
            return self._loose(schema, path, refs)
        try:
            return self._exact(schema, path, refs)
        except TooLarge:  # too many alternatives, say: lenient mode loosens this part
            if self.ctx.options.mode == STRICT:
                raise
            self.ctx.relaxed[path] = LOOSE
            return self._loose(schema, path, refs)

    def _exact(self, schema: Any, path: str, refs: tuple) -> str | None:
        flats = alternatives(schema, path, self.ctx, refs)
        options = self._literals(schema, flats)
        for flat in flats:
            if "enum" not in flat:
                options.extend(self._kinds(flat, refs))
        return union(options)

    def _loose(self, schema: Any, path: str, refs: tuple) -> str | None:
        """Any value of the kinds `schema` allows (a LOOSE relaxation, see schema_size): every
        keyword below it is reported unenforced."""
        kinds: set[str] = set()
        try:
            flats = alternatives(schema, path, self.ctx, refs)
        except TooLarge:
            flats = [{"path": path, "types": _declared_kinds(schema)}]
        for flat in flats:
            if "enum" in flat:
                kinds |= {json_kind(v) for v in flat["enum"]}
            else:
                kinds |= KINDS if flat.get("types") is None else flat["types"]
        for keyword in sorted(subtree_keywords(schema, path, self.ctx)):
            self.ctx.skip(keyword, path, "relaxed: the regex was over the size cap")
        if kinds >= KINDS:
            return json_value_regex(self.ctx.options.any_json_depth)
        loose = {"null": "null", "boolean": "(?:true|false)", "string": JSON_STRING}
        out = [loose[k] for k in ("null", "boolean", "string") if k in kinds]
        if kinds & {"integer", "fraction"}:
            out.append(JSON_NUMBER if "fraction" in kinds else JSON_INTEGER)
        out += [self.free(k) for k in ("array", "object") if k in kinds]
        return union(out)

    def all_of(self, schemas: list, path: str, refs: tuple) -> str | None:
        return self.value(schemas[0] if len(schemas) == 1 else {"allOf": schemas}, path, refs)

    def accepts(self, schemas: list, value: Any) -> bool:
        """Whether `value` is valid under every schema (jsonschema; True when it cannot tell)."""
        try:
            return all(
                self._validator.evolve(schema=s).is_valid(value)
                for s in schemas
                if isinstance(s, (dict, bool))
            )
        except Exception:  # noqa: BLE001 - a schema jsonschema itself cannot evaluate (an odd regex, a bad $ref)
            return True

    def _literals(self, schema: Any, flats: list[dict]) -> list[str]:
        out = []
        for flat in flats:
            for value in flat.get("enum", []):
                if _fits(value, flat) and self.accepts([schema], value):
                    out.append(
                        literal_text(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
                    )
        return list(dict.fromkeys(out))

    def _kinds(self, flat: dict, refs: tuple) -> list[str]:
        kinds = KINDS if flat.get("types") is None else flat["types"]
        refs = flat.get("refs", refs)
        free = not any(k in flat for keys in _TYPE_KEYS.values() for k in keys)
        if kinds == KINDS and free and not flat.get("not_values"):
            return [json_value_regex(self.ctx.options.any_json_depth)]
        out = []
        excluded = flat.get("not_values", [])
        if "null" in kinds and not any(v is None for v in excluded):
            out.append("null")
        if "boolean" in kinds:
            out.append(
                union(
                    [
                        b
                        for b in ("true", "false")
                        if not any(same_json(v, b == "true") for v in excluded)
                    ]
                )
            )
        if "integer" in kinds or "fraction" in kinds:
            out.append(self._number(flat, kinds))
        if "string" in kinds:
            out.append(string_regex(flat, self.ctx))
        if "array" in kinds:
            out.append(array_regex(self, flat, refs))
        if "object" in kinds:
            out.append(object_regex(self, flat, refs))
        return [r for r in out if r is not None]

    def _number(self, flat: dict, kinds: set) -> str | None:
        if "fraction" not in kinds:
            return integer_regex(flat, self.ctx)
        return number_regex(flat, self.ctx, integers="integer" in kinds)

    def free(self, kind: str) -> str:
        """Any object / array, containers nested at most any_json_depth deep."""
        inner = json_value_regex(max(self.ctx.options.any_json_depth - 1, 0))
        return json_object_regex(inner) if kind == "object" else json_array_regex(inner)


class RegexTooLong(ConstraintError):
    """The regex text passed MAX_REGEX_CHARS while building (see convert_schema)."""


def _declared_kinds(schema: Any) -> set[str] | None:
    names = schema.get("type") if isinstance(schema, dict) else None
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(n in TYPE_KINDS for n in names):
        return None
    return set().union(*(TYPE_KINDS[n] for n in names))


def _validator(root: Any):
    return validator_class(root)(root)


def _fits(value: Any, flat: dict) -> bool:
    if any(same_json(value, excluded) for excluded in flat.get("not_values", [])):
        return False
    kinds = flat.get("types")
    return kinds is None or json_kind(value) in kinds


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def union(options: list[str]) -> str | None:
    options = list(dict.fromkeys(o for o in options if o is not None))
    if not options:
        return None
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"


# -- arrays -------------------------------------------------------------------------------------


def array_regex(builder: RegexBuilder, flat: dict, refs: tuple) -> str | None:
    if not any(k in flat for k in _TYPE_KEYS["array"]):
        return builder.free("array")
    path, ctx = flat["path"], builder.ctx
    low, high = flat.get("minItems", 0), flat.get("maxItems")
    if high is not None and not ctx.keeps(BOUNDS, path, "maxItems"):
        high = None
    if low > 1 and not ctx.keeps(BOUNDS, path, "minItems"):
        low = 0
    if high is not None and high > MAX_ARRAY_ITEMS:
        ctx.skip("maxItems", path, f"{high} is above the cap of {MAX_ARRAY_ITEMS}")
        high = None
    if low > MAX_ARRAY_ITEMS:
        ctx.skip("minItems", path, f"{low} is above the cap of {MAX_ARRAY_ITEMS}")
        low = 0
    if high is not None and low > high:
        return None
    prefix = [
        builder.all_of(s, f"{path}/prefixItems/{i}", refs)
        for i, s in enumerate(flat.get("prefixItems", []))
    ]
    tail = _tail(builder, flat, path, refs)
    ws = builder.ws
    body = _items_from(0, prefix, tail, low, high, f"{ws},{ws}")
    return None if body is None else rf"\[{ws}{body}{ws}\]"


def _tail(builder: RegexBuilder, flat: dict, path: str, refs: tuple) -> str | None:
    items = flat.get("items", [])
    if False in items:
        return None
    items = [s for s in items if s is not True and s != {}]
    if not items:  # nested in the array: one level less
        return json_value_regex(max(builder.ctx.options.any_json_depth - 1, 0))
    return builder.all_of(items, f"{path}/items", refs)


def _items_from(
    i: int, prefix: list, tail: str | None, low: int, high: int | None, comma: str
) -> str | None:
    """Regex for the elements from position i on (i elements already written)."""
    sep = comma if i else ""
    if high is not None and i >= high:
        return "" if i >= low else None
    if i < len(prefix):
        rest = None if prefix[i] is None else _items_from(i + 1, prefix, tail, low, high, comma)
        take = None if rest is None else f"{sep}{prefix[i]}{rest}"
        if i >= low:
            return "" if take is None else f"(?:{take})?"
        return take
    if tail is None:
        return "" if i >= low else None
    need = max(low - i, 0)
    most = None if high is None else high - i
    if i == 0:
        first = f"{tail}(?:{comma}{tail}){_counts(max(need - 1, 0), None if most is None else most - 1)}"
        return first if need else f"(?:{first})?"
    return f"(?:{comma}{tail}){_counts(need, most)}"


def _counts(low: int, high: int | None) -> str:
    if high is None:
        return "*" if low == 0 else f"{{{low},}}"
    return f"{{{low},{high}}}" if high != low else f"{{{low}}}"
