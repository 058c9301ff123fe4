"""HTTP pieces shared by the native and the OpenAI routes: OpenAI-style error objects,
JSON and server-sent-event responses, the server state the routes read, and the waits that
abort a call when its client disconnects.

Every error is an OpenAI-style error object `{"error": {"message", "type", "param", "code"}}`
with its status code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from spruce.runtime.protocol.ipc import Ready
from spruce.runtime.server.metrics import Metrics
from spruce.runtime.server.native import ModelContext
from spruce.runtime.server.request_manager import Call, Event

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_object(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "message": message,
        "type": ERROR_TYPES.get(status, "invalid_request_error"),
        "param": param,
        "code": code,
    }


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    return orjson.dumps({"error": error_object(status, message, param, code)})


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        error_body(status, message, param, code), status_code=status, media_type="application/json"
    )


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class ServerState:
    """What the routes need, in one place (set on `app.state.server`)."""

    def __init__(self, launcher, model: ModelContext, metrics: Metrics, ready: Ready) -> None:
        self.launcher = launcher
        self.options = launcher.options
        self.manager = launcher.manager
        self.model = model
        self.metrics = metrics
        self.ready = ready
        self.started = time.time()

    @property
    def draining(self) -> bool:
        return self.launcher.draining

    def in_flight(self) -> int:
        return self.manager.in_flight


def validation_message(errors: list[dict]) -> str:
    parts = []
    for err in errors[:5]:
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def first_param(errors: list[dict]) -> str | None:
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return ".".join(loc)
    return None


async def json_body(request: Request) -> dict:
    body = await request.body()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def server_of(request: Request) -> ServerState:
    return request.app.state.server


def client_key(request: Request) -> str:
    """Whose requests these are, for --max-requests-per-client: the client's address."""
    return "h" + (request.client.host if request.client else "")


async def until_done_or_disconnect(request: Request, call: Call, work) -> Any:
    """Awaits `work`; if the client disconnects first, aborts the call and raises ApiError."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        call.close("the client disconnected")
        raise ApiError(499, "the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_response(request: Request, call: Call, chunks: AsyncIterator[bytes]) -> Response:
    """An SSE response; waits for the first chunk so that a request refused at once gets a
    proper error status instead of an error event."""
    try:
        first = await until_done_or_disconnect(request, call, anext(chunks))
    except BaseException:
        call.close()
        await chunks.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            call.close()
            await chunks.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def all_results(request: Request, call: Call) -> list[Event]:
    """Every result of a non-streaming call (aborted if the client leaves)."""
    try:
        return await until_done_or_disconnect(request, call, call.results())
    finally:
        call.close()


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_error(
    event: Event, nothing_sent: bool, message: str | None = None, with_index: bool = True
) -> bytes:
    """A request of a stream failed. Before the first chunk the error is the response's own
    HTTP status (raised); after it, an SSE error event (with the request's index, or
    OpenAI's bare `{"error": ...}`)."""
    message = event.error if message is None else message
    if nothing_sent:
        raise ApiError(event.status, message)
    body = {"index": event.index} if with_index else {}
    return sse({**body, "error": error_object(event.status, message)})
