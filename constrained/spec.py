"""Constraint specs: what a request asks for, validated before anything is compiled."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spruce.constrained.json_schema import load_schema, schema_to_regex
from spruce.constrained.limits import check_regex_size, parse_regex
from spruce.constrained.patterns import DTYPE_REGEXES, choices_regex, strip_anchors
from spruce.runtime.errors import ConstraintError

REGEX, JSON_SCHEMA = "regex", "json_schema"


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """`kind` is "regex" (value: the regex; choices and dtypes become regexes) or
    "json_schema" (value: the schema as JSON text, property order kept). Hashable: the
    compiled-grammar cache key."""

    kind: str
    value: str

    def to_regex(self, whitespace_pattern: str = "") -> str:
        """The constraint as a regex; re-validates (a spec may be built without make_spec)."""
        if self.kind == JSON_SCHEMA:
            return schema_to_regex(load_schema(self.value), whitespace_pattern)
        if self.kind == REGEX:
            return _regex_spec(self.value).value
        raise ConstraintError(
            f"unknown constraint kind {self.kind!r} (known: {REGEX}, {JSON_SCHEMA})"
        )


def make_spec(
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | tuple[str, ...] | None = None,
    dtype: type | str | None = None,
) -> ConstraintSpec | None:
    """Validates a constraint (at most one of the four) and returns its spec, or None when
    none is given. Raises ConstraintError for anything invalid or unsupported.

    json_schema: a dict, a JSON string or a pydantic model class. choices: the output is one
    of the strings. dtype: int, float, bool, str (or their names): see DTYPE_REGEXES."""
    candidates = {"regex": regex, "json_schema": json_schema, "choices": choices, "dtype": dtype}
    given = [name for name, value in candidates.items() if value is not None]
    if len(given) > 1:
        raise ConstraintError(f"give at most one constraint; got {', '.join(given)}")
    if regex is not None:
        return _regex_spec(regex)
    if json_schema is not None:
        schema = load_schema(json_schema)
        schema_to_regex(schema)  # every check, before any compute (a few ms)
        return ConstraintSpec(JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))
    if choices is not None:
        return _regex_spec(choices_regex(_checked_choices(choices)))
    if dtype is not None:
        return _regex_spec(DTYPE_REGEXES[_dtype_name(dtype)])
    return None


def _regex_spec(regex: Any) -> ConstraintSpec:
    if not isinstance(regex, str):
        raise ConstraintError(f"regex must be a string; got {type(regex).__name__}")
    regex = strip_anchors(regex)
    check_regex_size(regex, parse_regex(regex))
    return ConstraintSpec(REGEX, regex)


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
