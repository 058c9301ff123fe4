"""Errors a DSL user can cause or meet. All derive from `spruce.runtime.errors.SpruceError`."""

from __future__ import annotations

from spruce.runtime.errors import SpruceError


class ProgramError(SpruceError, ValueError):
    """A program that uses the DSL wrongly (a role closed that is not open, a select with
    no choices, no backend...)."""


class UnsupportedFeatureError(ProgramError):
    """A DSL feature this runtime or model does not have (images: no vision encoder)."""


class RuntimeUnavailableError(SpruceError, ConnectionError):
    """No Spruce runtime answers at the address (or it stopped answering)."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(message)
        self.address = address


class RuntimeRequestError(SpruceError):
    """The runtime refused or failed a request; `message` is the runtime's own words and
    `status` its HTTP-like code (400: bad input, e.g. an invalid constraint)."""

    def __init__(self, message: str, status: int = 400, address: str | None = None) -> None:
        where = f" (runtime at {address})" if address else ""
        super().__init__(f"{message}{where}")
        self.message = message
        self.status = status
        self.address = address
