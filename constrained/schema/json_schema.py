"""JSON schema -> regex of compact JSON text, converted here (schema_* modules), not by
outlines-core's `build_regex_from_schema`, which ignores or mistranslates many keywords.

    schema_normalize  $ref, allOf / anyOf / oneOf / not / if / dependencies -> flat alternatives
    schema_merge      the intersection of flat alternatives
    schema_negate     `not` in its flat forms; disjointness (exact oneOf)
    schema_refs       `$ref` inside the document ("#/...", anchors, its own $id)
    schema_scalars    strings (patterns, lengths, formats on automata), numbers, multipleOf
    schema_objects    properties, patternProperties, additionalProperties, propertyNames, counts
    schema_regex      the builder: literals (enum / const, any JSON value), arrays, dispatch

Unknown keywords are annotations (ignored, as the specification says). A known keyword that
cannot be enforced (uniqueItems, contains, not of a complex schema, ...) is refused in strict
mode and listed in `SchemaRegex.unenforced` in lenient mode. Recursive schemas are unrolled
`recursion_depth` times; free values ("any JSON") nest `any_json_depth` containers deep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spruce.constrained.automaton.byte_nfa import parse_regex
from spruce.constrained.automaton.limits import MAX_EXPANDED_SIZE, regex_size
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.schema.schema_context import LOOSE, STRICT, Context, SchemaOptions
from spruce.constrained.schema.schema_regex import RegexBuilder, RegexTooLong
from spruce.constrained.schema.schema_size import (
    MAX_RELAX_ROUNDS,
    relax,
    relax_overflow,
    too_large_message,
)


@dataclass(frozen=True, slots=True)
class SchemaRegex:
    """The regex, the keywords it does not enforce (lenient mode; empty when exact), the
    property order of each object it builds (see `canonical_instance`), and the schema paths
    loosened to fit the size cap (lenient mode; "#": the whole schema)."""

    regex: str
    unenforced: tuple[str, ...]
    unenforced_at: dict[str, list[str]]
    orders: tuple[tuple[str, ...], ...] = ()
    loosened: tuple[str, ...] = ()  # schema paths relaxed to any value of their types (size cap)


def convert_schema(schema: Any, options: SchemaOptions | None = None) -> SchemaRegex:
    """Converts `schema` (JSON data). ConstraintError for an invalid schema, one that allows
    nothing, a keyword strict mode cannot enforce, or a regex over the size cap that strict
    mode cannot take (naming the schema paths that make it large) or lenient mode cannot
    relax under it (see schema_size)."""
    options = options or SchemaOptions()
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(
            f"a JSON schema must be an object or a boolean (got {json.dumps(schema)[:80]})"
        )
    try:
        return _convert(schema, options)
    finally:
        regex_size.cache_clear()  # it holds this schema's part regexes (megabytes for a large one)


def _convert(schema: Any, options: SchemaOptions) -> SchemaRegex:
    relaxed: dict[str, int] = {}
    overflow: RegexTooLong | None = None
    for _ in range(MAX_RELAX_ROUNDS + 1):
        ctx = Context(schema, options, relaxed)
        builder = RegexBuilder(ctx)
        try:
            regex, overflow = builder.value(schema, "#"), None
        except RegexTooLong as e:
            if options.mode == STRICT or not relax_overflow(builder.root_part, relaxed):
                raise
            overflow = e
            continue
        if regex is None:
            raise ConstraintError(
                "the JSON schema allows no value (its constraints contradict each other)"
            )
        size = regex_size(regex)
        if size <= MAX_EXPANDED_SIZE:
            break
        if options.mode == STRICT or not relax(builder.root_part, size, ctx, relaxed):
            raise ConstraintError(too_large_message(builder.root_part, size))
    else:
        raise overflow or ConstraintError(too_large_message(builder.root_part, size))
    parse_regex(regex)  # what the automata support: a converter bug fails here, not later
    places = ctx.unenforced.places
    loosened = tuple(path for path, level in relaxed.items() if level >= LOOSE)
    return SchemaRegex(
        regex, ctx.unenforced.keywords(), places, tuple(dict.fromkeys(builder.orders)), loosened
    )


def schema_to_regex(schema: Any, whitespace_pattern: str = "", mode: str = "strict") -> str:
    """The regex alone (strict mode by default: every keyword enforced or an error)."""
    return convert_schema(
        schema, SchemaOptions(mode=mode, whitespace_pattern=whitespace_pattern)
    ).regex


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


def canonical_instance(value: Any, orders: tuple[tuple[str, ...], ...]) -> str:
    """Compact JSON of `value` with each object's keys in the order the grammar writes them
    (the recorded order that covers most of its keys; extra keys after, as given)."""
    if isinstance(value, dict):
        order = _best_order(list(value), orders)
        rank = {name: i for i, name in enumerate(order)}
        keys = sorted(value, key=lambda k: rank.get(k, len(rank)))
        items = (
            f"{json.dumps(k, ensure_ascii=False)}:{canonical_instance(value[k], orders)}"
            for k in keys
        )
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(canonical_instance(v, orders) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _best_order(keys: list[str], orders: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    present = set(keys)
    best, best_score = (), 0
    for order in orders:
        score = len(present.intersection(order))
        if score > best_score or (score == best_score and score and len(order) < len(best)):
            best, best_score = order, score
    return best


def declared_orders(schema: Any) -> tuple[tuple[str, ...], ...]:
    """Every object's property order as the schema declares it (`properties`, then required
    names it does not list): the order of definition, for `canonical_instance` when no
    conversion recorded one (comparing engines that all write definition order)."""
    found, todo = [], [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            names = list(node["properties"]) if isinstance(node.get("properties"), dict) else []
            required = node.get("required") if isinstance(node.get("required"), list) else []
            names += [n for n in required if isinstance(n, str) and n not in names]
            if names:
                found.append(tuple(names))
            todo.extend(
                v for k, v in node.items() if k not in ("enum", "const", "default", "examples")
            )
        elif isinstance(node, list):
            todo.extend(node)
    return tuple(dict.fromkeys(found))
