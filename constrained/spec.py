"""Constraint specs: what a request asks for, validated before anything is compiled."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from spruce.constrained.errors import ConstraintError
from spruce.constrained.json_schema import convert_schema, load_schema
from spruce.constrained.byte_nfa import parse_regex
from spruce.constrained.limits import check_regex_size
from spruce.constrained.patterns import DTYPE_REGEXES, choices_regex, strip_anchors
from spruce.constrained.schema_context import LENIENT, SchemaOptions

REGEX, JSON_SCHEMA = "regex", "json_schema"


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """`kind` is "regex" (value: the regex; choices and dtypes become regexes) or
    "json_schema" (value: the schema as JSON text, property order kept); `regex` is the
    constraint as a regex, converted once by `make_spec` and carried from then on.
    `variant`: the conversion options that differ from the defaults (they change the regex).
    `unenforced`: the schema keywords the regex does not enforce (lenient mode): the output
    is validated against the schema once finished (see `schema_report`).
    Hashable on (kind, value, variant): the compiled-grammar cache key."""

    kind: str
    value: str
    regex: str = field(compare=False)
    variant: str = ""
    unenforced: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "value": self.value, "regex": self.regex,
            "variant": self.variant, "unenforced": list(self.unenforced),
        }  # fmt: skip


def make_spec(
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | tuple[str, ...] | None = None,
    dtype: type | str | None = None,
    whitespace_pattern: str = "",
    schema_mode: str = LENIENT,
    schema_options: SchemaOptions | None = None,
) -> ConstraintSpec | None:
    """Validates a constraint (at most one of the four) and returns its spec, or None when
    none is given. Raises ConstraintError for anything invalid or unsupported.

    json_schema: a dict, a JSON string or a pydantic model class. choices: the output is one
    of the strings. dtype: int, float, bool, str (or their names): see DTYPE_REGEXES.
    whitespace_pattern: the whitespace a JSON schema's output may hold between tokens.
    schema_mode: "lenient" (default: a keyword that cannot be enforced is left out of the
    grammar and listed in `unenforced`) or "strict" (refused, naming it).
    schema_options: recursion_depth, any_json_depth, property order (see SchemaOptions);
    its mode and whitespace_pattern are replaced by the two arguments above."""
    candidates = {"regex": regex, "json_schema": json_schema, "choices": choices, "dtype": dtype}
    given = [name for name, value in candidates.items() if value is not None]
    if len(given) > 1:
        raise ConstraintError(f"give at most one constraint; got {', '.join(given)}")
    if regex is not None:
        return _regex_spec(regex)
    if json_schema is not None:
        return _schema_spec(json_schema, whitespace_pattern, schema_mode, schema_options)
    if choices is not None:
        return _regex_spec(choices_regex(_checked_choices(choices)))
    if dtype is not None:
        return _regex_spec(DTYPE_REGEXES[_dtype_name(dtype)])
    return None


def _schema_spec(json_schema: Any, whitespace: str, mode: str, options: SchemaOptions | None) -> ConstraintSpec:
    options = replace(options or SchemaOptions(), mode=mode, whitespace_pattern=whitespace)
    schema = load_schema(json_schema)
    converted = convert_schema(schema, options)  # every check, before any compute
    text = json.dumps(schema, ensure_ascii=False)
    return ConstraintSpec(JSON_SCHEMA, text, converted.regex, _variant(options), converted.unenforced)


def _variant(options: SchemaOptions) -> str:
    """The options that change the regex, where they differ from the defaults."""
    default = SchemaOptions()
    names = ("recursion_depth", "any_json_depth", "property_order", "any_order_max", "open_objects", "whitespace_pattern")
    return ",".join(f"{n}={getattr(options, n)!r}" for n in names if getattr(options, n) != getattr(default, n))


def _regex_spec(regex: Any) -> ConstraintSpec:
    if not isinstance(regex, str):
        raise ConstraintError(f"regex must be a string; got {type(regex).__name__}")
    regex = strip_anchors(regex)
    check_regex_size(regex, parse_regex(regex))
    return ConstraintSpec(REGEX, regex, regex)


def _checked_choices(choices: Any) -> list[str]:
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)):
        raise ConstraintError("choices must be a list of strings")
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ConstraintError("choices must be a non-empty list of strings")
    return list(choices)


def _dtype_name(dtype: Any) -> str:
    name = dtype.__name__ if isinstance(dtype, type) else dtype
    if name not in DTYPE_REGEXES:
        raise ConstraintError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_REGEXES)}")
    return name
