"""Typed errors for everything a user can cause. Internal invariants use assert."""

from __future__ import annotations

from spruce.constrained.core import errors as constrained_errors

# What a client is told of a failure that is not its doing (the server log has the details).
INTERNAL_ERROR = "internal server error; the server's log has the details"


class SpruceError(Exception):
    """Base class: the message is meant for the user and says what to change."""


class ModelLoadError(SpruceError):
    """A model path, file or config that cannot be loaded."""


class InvalidRequestError(SpruceError, ValueError):
    """A request the runtime refuses before computing anything (bad parameters, too long)."""


class ConstraintError(InvalidRequestError, constrained_errors.ConstraintError):
    """An invalid or unsupported regex / JSON schema / choices constraint. The runtime's
    form of `spruce.constrained.ConstraintError` (a subclass of both)."""


def constraint_error(error: constrained_errors.ConstraintError) -> ConstraintError:
    """The runtime's ConstraintError for one raised by spruce.constrained."""
    return error if isinstance(error, ConstraintError) else ConstraintError(str(error))
