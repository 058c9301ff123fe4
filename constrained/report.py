"""What a finished JSON-schema output is told: which keywords the grammar did not enforce
(lenient mode) and whether the output validates against the schema (`jsonschema`)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from spruce.constrained.schema.schema_validator import validator_class
from spruce.constrained.spec import JSON_SCHEMA, ConstraintSpec


def schema_report(spec: ConstraintSpec | None, text: str) -> dict[str, Any] | None:
    """{"unenforced": [...], "valid": bool, "error": str | None} for a JSON-schema spec,
    None for other constraints. The output is validated with formats asserted."""
    if spec is None or spec.kind != JSON_SCHEMA:
        return None
    return {"unenforced": list(spec.unenforced), **validate_output(json.loads(spec.value), text)}


def validate_output(schema: Any, text: str) -> dict[str, Any]:
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as e:
        return {"valid": False, "error": f"not JSON: {e}"}
    except (
        ValueError,
        RecursionError,
    ) as e:  # JSON Python will not read: an integer past its digit limit, deep nesting
        return {
            "valid": None,
            "error": f"could not validate: {str(e).split(';')[0] or type(e).__name__}",
        }
    cls = validator_class(schema)
    try:
        error = jsonschema.exceptions.best_match(
            cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance)
        )
    except Exception as e:  # noqa: BLE001 - a $ref to another document, a regex the linear engine cannot take
        return {"valid": None, "error": f"could not validate: {e}"}
    if error is None:
        return {"valid": True, "error": None}
    where = "/".join(str(p) for p in error.absolute_path)
    return {"valid": False, "error": f"{error.message} (at /{where})"}


def violated_keywords(schema: Any, instance: Any) -> set[str] | None:
    """The keywords `instance` violates under `schema`, formats asserted (the errors inside
    anyOf / oneOf branches included, and the applicators they sit under); empty when it is
    valid, None when jsonschema cannot tell (a pattern Python cannot compile, a $ref to
    another document)."""
    cls = validator_class(schema)
    try:
        todo = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance))
    except Exception:  # noqa: BLE001 - as in validate_output
        return None
    found = set()
    while todo:
        error = todo.pop()
        found.add(str(error.validator))
        found.update(
            p for p in error.relative_schema_path if p in _APPLICATORS
        )  # inside `then`: `then` too
        todo.extend(error.context or ())
    return found


# Keywords whose subschemas' errors are theirs too: a keyword broken inside an unenforced
# `then` breaks `then`.
_APPLICATORS = frozenset(
    {
        "if",
        "then",
        "else",
        "not",
        "oneOf",
        "anyOf",
        "allOf",
        "dependentSchemas",
        "dependencies",
        "propertyNames",
    }
)


def excused(schema: Any, instance: Any, unenforced: tuple[str, ...] | list[str]) -> bool:
    """Whether an invalid `instance` the grammar accepted breaks a keyword it reported not
    enforcing (when jsonschema cannot tell which keyword: whether any was reported)."""
    broken = violated_keywords(schema, instance)
    return bool(unenforced) if broken is None else bool(broken & set(unenforced))
