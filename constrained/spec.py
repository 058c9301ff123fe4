"""Constraint specs: what a request asks for, validated before anything is compiled."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spruce.constrained.json_schema import load_schema, schema_to_regex
from spruce.constrained.limits import check_regex_size, parse_regex
from spruce.constrained.patterns import DTYPE_REGEXES, choices_regex, strip_anchors
from spruce.constrained.errors import ConstraintError

REGEX, JSON_SCHEMA = "regex", "json_schema"


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """`kind` is "regex" (value: the regex; choices and dtypes become regexes) or
    "json_schema" (value: the schema as JSON text, property order kept); `regex` is the
    constraint as a regex, converted once by `make_spec` and carried from then on.
    Hashable on (kind, value): the compiled-grammar cache key."""

    kind: str
    value: str
    regex: str = field(compare=False)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value, "regex": self.regex}


def make_spec(
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | tuple[str, ...] | None = None,
    dtype: type | str | None = None,
    whitespace_pattern: str = "",
) -> ConstraintSpec | None:
    """Validates a constraint (at most one of the four) and returns its spec, or None when
    none is given. Raises ConstraintError for anything invalid or unsupported.

    json_schema: a dict, a JSON string or a pydantic model class. choices: the output is one
    of the strings. dtype: int, float, bool, str (or their names): see DTYPE_REGEXES.
    whitespace_pattern: the whitespace a JSON schema's output may hold between tokens."""
    candidates = {"regex": regex, "json_schema": json_schema, "choices": choices, "dtype": dtype}
    given = [name for name, value in candidates.items() if value is not None]
    if len(given) > 1:
        raise ConstraintError(f"give at most one constraint; got {', '.join(given)}")
    if regex is not None:
        return _regex_spec(regex)
    if json_schema is not None:
        schema = load_schema(json_schema)
        regex = schema_to_regex(schema, whitespace_pattern)  # every check, before any compute
        return ConstraintSpec(JSON_SCHEMA, json.dumps(schema, ensure_ascii=False), regex)
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
