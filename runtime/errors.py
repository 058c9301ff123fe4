"""Typed errors for everything a user can cause. Internal invariants use assert."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from spruce.constrained.backends import GRAMMAR_KINDS
from spruce.constrained.core import errors as constrained_errors

# What a client is told of a failure that is not its doing (the server log has the details).
INTERNAL_ERROR = "internal server error; the server's log has the details"


class SpruceError(Exception):
    """Base class: the message is meant for the user and says what to change."""


class ModelLoadError(SpruceError):
    """A model path, file or config that cannot be loaded."""


class InvalidRequestError(SpruceError, ValueError):
    """A request the runtime refuses before computing anything (bad parameters, too long).
    `field`: the request field it is about, by its canonical name (a SamplingParams or
    RequestOptions field, or text / input_ids / prompt / sampling_params / n), or None; an
    API reports it in its own spelling (`FieldNames`), e.g. as OpenAI's `param`."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ConstraintError(InvalidRequestError, constrained_errors.ConstraintError):
    """An invalid or unsupported regex / JSON schema / choices constraint. The runtime's
    form of `spruce.constrained.ConstraintError` (a subclass of both)."""


@dataclass(frozen=True)
class FieldNames:
    """How one API spells the request's fields: canonical name -> the API's name (OpenAI's
    max_tokens for max_new_tokens). Validation builds its messages with it, so each API's
    errors name the fields as its callers wrote them; a field not listed keeps its name."""

    spelling: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, canonical: str) -> str:
        return self.spelling.get(canonical, canonical)

    def error(self, canonical: str, rest: str) -> InvalidRequestError:
        """`<the field's name> <rest>`, e.g. names.error("top_k", "must be -1 (off) or >= 1")."""
        return InvalidRequestError(f"{self(canonical)} {rest}", field=canonical)


def constraint_error(
    error: constrained_errors.ConstraintError, field: str | None = None
) -> ConstraintError:
    """The runtime's ConstraintError for one raised by spruce.constrained, about constraint
    field `field` when given (a grammar's message gets the field's name in front: `lark:
    the grammar matches no string`; regex / schema / choices messages name theirs)."""
    if isinstance(error, ConstraintError) and (field is None or error.field is not None):
        return error
    message = str(error)
    if field in GRAMMAR_KINDS and not message.startswith(field):
        message = f"{field}: {message}"
    return ConstraintError(message, field=field)
