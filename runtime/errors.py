"""Typed errors for everything a user can cause. Internal invariants use assert."""

from __future__ import annotations


class SpruceError(Exception):
    """Base class: the message is meant for the user and says what to change."""


class ModelLoadError(SpruceError):
    """A model path, file or config that cannot be loaded."""


class InvalidRequestError(SpruceError, ValueError):
    """A request the runtime refuses before computing anything (bad parameters, too long)."""


class ConstraintError(InvalidRequestError):
    """An invalid or unsupported regex / JSON schema / choices constraint."""
