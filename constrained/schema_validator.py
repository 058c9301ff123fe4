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
_ECMA_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?![=!])")


def validator_class(schema: Any) -> type:
    base = jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {}, default=jsonschema.Draft202012Validator)
    return _extended(base)


def python_pattern(pattern: str) -> str:
    return _ECMA_NAMED_GROUP.sub("(?P<", pattern)


@cache
def _extended(base: type) -> type:
    latest = jsonschema.Draft202012Validator.VALIDATORS
    added = {k: latest[k] for k in _LATER_KEYWORDS if k not in base.VALIDATORS}
    added.update(pattern=_pattern, patternProperties=_pattern_properties)
    return jsonschema.validators.extend(base, added)


def _pattern(validator, pattern: str, instance: Any, schema: dict):
    if validator.is_type(instance, "string") and not re.search(python_pattern(pattern), instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns: dict, instance: Any, schema: dict):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if re.search(python_pattern(pattern), key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)
