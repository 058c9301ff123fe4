"""The HTTP server's connection rules: uvicorn's h11 protocol with a deadline for a
request's headers (uvicorn has none: a client that sends one header byte every few seconds
would hold its connection for ever: slowloris). The cap on open connections is uvicorn's
own `limit_concurrency` (requests past it get 503)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    """Closes a connection that has not sent a whole request head within `header_timeout_s`
    of opening, or of the end of its previous response (the clock of a keep-alive
    connection restarts after each response)."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self._request_started():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._request_started():  # else a pipelined request's head is already in
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _request_started(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if not self._request_started():
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's `http=` setting, with this deadline."""
    return type(
        "HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s}
    )
