"""The one error type of spruce.constrained (a leaf: it imports nothing from the runtime)."""

from __future__ import annotations


class ConstraintError(ValueError):
    """An invalid or unsupported regex / JSON schema / choices constraint; the message says
    what to change."""
