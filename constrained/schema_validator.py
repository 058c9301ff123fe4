"""The `jsonschema` validator class for a schema, read the way the converter reads it: every
draft's keywords apply whatever `$schema` says (a draft-04 schema using `const` or
`propertyNames` means them, as the converter and most tools take it), and patterns may use
ECMA 262's named groups `(?<name>...)`, which Python's `re` spells `(?P<name>...)`."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

# Keywords of later drafts that an older draft's validator lacks and that mean nothing else there.
_LATER_KEYWORDS = ("const", "contains", "propertyNames", "if", "dependentRequired", "dependentSchemas")
_ECMA_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?![=!])")  # "(?<name>", not a lookbehind
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?P<[A-Za-z_][A-Za-z0-9_]*>")


def validator_class(schema: Any) -> type:
    base = jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {}, default=jsonschema.Draft202012Validator)
    return _extended(base)


def python_pattern(pattern: str) -> str:
    return _ECMA_NAMED_GROUP.sub("(?P<", pattern)


def plain_groups(pattern: str) -> str:
    """Named groups (either spelling) as plain groups, for the automata (which have no names)."""
    return _NAMED_GROUP.sub("(?:", python_pattern(pattern))


def pattern_search(pattern: str, text: str) -> bool:
    """Whether a JSON Schema pattern (ECMA spelling) matches somewhere in `text`; re.error
    when Python cannot compile it."""
    return re.search(python_pattern(pattern), text) is not None


@cache
def _extended(base: type) -> type:
    latest = jsonschema.Draft202012Validator.VALIDATORS
    added = {k: latest[k] for k in _LATER_KEYWORDS if k not in base.VALIDATORS}
    added.update(pattern=_pattern, patternProperties=_pattern_properties)
    return jsonschema.validators.extend(base, added)


def _pattern(validator, pattern: str, instance: Any, schema: dict):
    if validator.is_type(instance, "string") and not pattern_search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns: dict, instance: Any, schema: dict):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if pattern_search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)
