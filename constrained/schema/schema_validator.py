"""The `jsonschema` validator class for a schema, read the way the converter reads it: every
draft's keywords apply whatever `$schema` says (a draft-04 schema using `const` or
`propertyNames` means them, as the converter and most tools take it), and patterns may use
ECMA 262's named groups `(?<name>...)`, which Python's `re` spells `(?P<name>...)`.

Patterns are matched in linear time (constrained/core/linear_regex.py, RE2), never with Python's
backtracking `re`: the keywords that match patterns (`pattern`, `patternProperties`,
`additionalProperties`) are replaced here, and `unevaluatedProperties` is not checked in a
schema that has `patternProperties` (jsonschema would search those with `re`). Lookaheads at
the start of an anchored alternative, which RE2 lacks, are read as the converter reads them:
`^(?=A)(?!B)C` matches when `^A` and `^C` do and `^B` does not."""

from __future__ import annotations

import re
from functools import cache
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from spruce.constrained.core import linear_regex
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.core.linear_regex import UnsupportedRegex

# Keywords of later drafts that an older draft's validator lacks and that mean nothing else there.
_LATER_KEYWORDS = (
    "const",
    "contains",
    "propertyNames",
    "if",
    "dependentRequired",
    "dependentSchemas",
)
_ECMA_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?![=!])")  # "(?<name>", not a lookbehind
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?P<[A-Za-z_][A-Za-z0-9_]*>")
_OLD_DRAFTS = (jsonschema.Draft3Validator, jsonschema.Draft4Validator)


def validator_class(schema: Any) -> type:
    """ConstraintError naming the keyword when the root's `$schema` or `$id` is not a string."""
    base = check_root_ids(schema)
    return _extended(
        base, _has_key(schema, "patternProperties") and _has_key(schema, "unevaluatedProperties")
    )


def check_root_ids(schema: Any) -> type:
    """The draft's validator class (jsonschema's, by `$schema`); ConstraintError naming the
    keyword when the root's `$schema` or `$id` is not a string (what validator_class refuses,
    checked at the front door without walking the schema)."""
    _check_string(schema, "$schema")
    base = jsonschema.validators.validator_for(
        schema if isinstance(schema, dict) else {}, default=jsonschema.Draft202012Validator
    )
    _check_string(schema, "id" if base in _OLD_DRAFTS else "$id")
    return base


def python_pattern(pattern: str) -> str:
    return _ECMA_NAMED_GROUP.sub("(?P<", pattern)


def plain_groups(pattern: str) -> str:
    """Named groups (either spelling) as plain groups, for the automata (which have no names)."""
    return _NAMED_GROUP.sub("(?:", python_pattern(pattern))


def pattern_search(pattern: str, text: str) -> bool:
    """Whether a JSON Schema pattern (ECMA spelling) matches somewhere in `text`, in linear
    time; UnsupportedRegex (a ConstraintError) when the linear engine cannot take it."""
    try:
        return linear_regex.search(pattern, text) is not None
    except UnsupportedRegex:
        branches = top_level_branches(pattern)
        if not any(leading_lookaheads(b)[0] for b in branches):
            raise
    return any(_branch_search(branch, text) for branch in branches)


def _branch_search(branch: str, text: str) -> bool:
    lookaheads, rest = leading_lookaheads(branch)
    if any(
        (linear_regex.search(f"^(?:{inner})", text) is None) != negative
        for negative, inner in lookaheads
    ):
        return False
    return linear_regex.search(rest, text) is not None


def leading_lookaheads(branch: str) -> tuple[list[tuple[bool, str]], str]:
    """The lookaheads right after a branch's `^` as (negative, inner), and the branch without them."""
    found, i = [], 1
    while branch.startswith("^", 0) and branch.startswith(("(?=", "(?!"), i):
        end = group_end(branch, i)
        found.append((branch[i + 2] == "!", branch[i + 3 : end - 1]))
        i = end
    return found, (branch if not found else "^" + branch[i:])


def group_end(pattern: str, start: int) -> int:
    """The index just past the group opening at `start`."""
    for i, char, depth in _structure(pattern, start):
        if char == ")" and depth == 0:
            return i + 1
    raise ConstraintError("unbalanced parentheses")


def top_level_branches(pattern: str) -> list[str]:
    branches, start = [], 0
    for i, char, depth in _structure(pattern):
        if char == "|" and depth == 0:
            branches.append(pattern[start:i])
            start = i + 1
    return [*branches, pattern[start:]]


def _structure(pattern: str, start: int = 0):
    """(index, character, group depth after it) of each character outside escapes and classes."""
    depth, i, in_class = 0, start, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1 + pattern.startswith("^", i + 1)
            i += pattern.startswith("]", i)  # a leading ']' is a literal
            continue
        else:
            depth += (char == "(") - (char == ")")
            yield i, char, depth
        i += 1


def _check_string(schema: Any, keyword: str) -> None:
    if isinstance(schema, dict) and keyword in schema and not isinstance(schema[keyword], str):
        raise ConstraintError(f"{keyword} must be a string (got {type(schema[keyword]).__name__})")


def _has_key(schema: Any, key: str) -> bool:
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if key in node:
                return True
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return False


@cache
def _extended(base: type, without_unevaluated: bool) -> type:
    latest = jsonschema.Draft202012Validator.VALIDATORS
    added = {k: latest[k] for k in _LATER_KEYWORDS if k not in base.VALIDATORS}
    added.update(
        pattern=_pattern,
        patternProperties=_pattern_properties,
        additionalProperties=_additional_properties,
    )
    if without_unevaluated and "unevaluatedProperties" in base.VALIDATORS:
        added["unevaluatedProperties"] = _unevaluated_properties
    return jsonschema.validators.extend(base, added)


def _pattern(validator, pattern: str, instance: Any, schema: dict):
    if validator.is_type(instance, "string") and not pattern_search(pattern, instance):
        yield ValidationError(f"{instance[:80]!r} does not match {pattern[:80]!r}")


def _pattern_properties(validator, patterns: dict, instance: Any, schema: dict):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if pattern_search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, extra_schema: Any, instance: Any, schema: dict):
    """jsonschema's additionalProperties, with patternProperties searched in linear time."""
    if not validator.is_type(instance, "object"):
        return
    declared, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [
        k for k in instance if k not in declared and not any(pattern_search(p, k) for p in patterns)
    ]
    if validator.is_type(extra_schema, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], extra_schema, path=extra)
    elif extra_schema is False and extras:
        names = ", ".join(map(repr, sorted(extras)))
        if patterns:
            yield ValidationError(
                f"{names} do not match any of the regexes: {', '.join(map(repr, sorted(patterns)))}"
            )
        else:
            yield ValidationError(f"Additional properties are not allowed ({names} unexpected)")


def _unevaluated_properties(validator, value: Any, instance: Any, schema: dict):
    raise ConstraintError(
        "unevaluatedProperties is not checked in a schema with patternProperties "
        "(jsonschema would search those with a backtracking regex)"
    )
