"""The one error type of spruce.constrained (a leaf: it imports nothing from the runtime)."""

from __future__ import annotations


class ConstraintError(ValueError):
    """An invalid or unsupported regex / JSON schema / choices constraint; the message says
    what to change."""


class TooLarge(ConstraintError):
    """A size cap was hit while converting (alternatives, automaton states, regex text):
    lenient mode may relax the part of the schema that hit it instead."""


class GrammarRefused(ConstraintError):
    """A backend cannot compile this constraint (auto may give it to the next backend)."""
