"""The HTTP API: native routes (/generate, /model_info, /server_info, /flush_cache,
/abort_request, /health, /metrics) and the OpenAI-compatible routes (openai_api.py).

Every error is an OpenAI-style error object `{"error": {"message", "type", "param", "code"}}`
with its status code. An ASGI middleware in front of everything checks the API key and
the body size, and answers 503 while the model loads and while the server drains.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.server.messages import Ready
from spruce.runtime.server.metrics import Metrics
from spruce.runtime.server.native import ModelContext, prepare_generate
from spruce.runtime.server.protocol import GenerateMsg
from spruce.runtime.server.request_manager import Call, Event, SchedulerUnavailable

logger = logging.getLogger("spruce.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
STATS_TIMEOUT_S = 5.0
FLUSH_TIMEOUT_S = 30.0


class ApiError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_object(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param, "code": code}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps({"error": error_object(status, message, param, code)})


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    return Response(error_body(status, message, param, code), status_code=status, media_type="application/json")


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


def build_app(launcher, model: ModelContext, metrics: Metrics, ready: Ready) -> FastAPI:
    from spruce.runtime.server.openai_api import router as openai_router

    app = FastAPI(title="Spruce", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(launcher, model, metrics, ready)
    app.include_router(native_routes())
    app.include_router(openai_router)
    _add_error_handlers(app)
    return app


# -- middleware ----------------------------------------------------------------------------


class GuardMiddleware:
    """The outer ASGI layer: 503 while the model loads (`app` is None) and while the server
    drains; the API key on every route but /health (401); the body size limit (413). The
    body is read here (bounded) and replayed to the app."""

    def __init__(self, options, launcher) -> None:
        self.app = None  # set once the model is loaded
        self.expected = f"Bearer {options.api_key}".encode() if options.api_key else None
        self.max_bytes = options.max_request_bytes
        self.launcher = launcher

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        if self.launcher.draining:
            return await _send_error(send, 503, "the server is shutting down")
        if self.expected is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                return await _send_error(send, 401, message, code="invalid_api_key")
        if self.app is None:
            return await _send_error(send, 503, "the model is still loading; retry when /health answers 200")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, 413, _too_large(self.max_bytes))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_body(receive, self.max_bytes)
            if body is None:
                return await _send_error(send, 413, _too_large(self.max_bytes))
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _read_body(receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: http.disconnect when the client goes away

    return replayed


async def _send_error(send, status: int, message: str, code: str | None = None) -> None:
    body = error_body(status, message, code=code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _too_large(limit: int) -> str:
    return f"request body larger than the server's limit of {limit} bytes (--max-request-bytes)"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError) -> Response:
        return error_response(400, str(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return error_response(400, validation_message(e.errors()), param=_first_param(e.errors()))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}")


def validation_message(errors: list[dict]) -> str:
    parts = []
    for err in errors[:5]:
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def _first_param(errors: list[dict]) -> str | None:
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc:
            return ".".join(loc)
    return None


# -- helpers shared with the OpenAI routes ------------------------------------------------------


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


def first_error(events: list[Event]) -> Event | None:
    return next((e for e in events if e.error is not None), None)


async def all_results(request: Request, call: Call) -> tuple[list[Event], Event | None]:
    """Every result of a non-streaming call (aborted if the client leaves) and the first
    failed one, if any."""
    try:
        events = await until_done_or_disconnect(request, call, call.results())
    finally:
        call.close()
    return events, first_error(events)


def sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- native routes ------------------------------------------------------------------------------


def native_routes():
    from fastapi import APIRouter

    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        server = server_of(request)
        if server.draining:
            return error_response(503, "the server is shutting down")
        try:
            await server.manager.control("ping", server.options.health_timeout_s)
        except SchedulerUnavailable as e:
            return error_response(503, str(e))
        return json_response({"status": "ok"})

    @router.get("/model_info")
    async def model_info(request: Request) -> Response:
        return json_response(server_of(request).model.info())

    @router.get("/server_info")
    async def server_info(request: Request) -> Response:
        server = server_of(request)
        stats = await _stats(server)
        return json_response({
            "model": server.model.info(),
            "engine_config": server.ready.config,
            "server_options": server.options.to_dict(),
            "kv_slots_total": server.ready.kv_slots,
            "in_flight_requests": server.in_flight(),
            "scheduler": stats,
        })  # fmt: skip

    @router.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        try:
            await server_of(request).manager.control("flush_cache", FLUSH_TIMEOUT_S)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except SchedulerUnavailable as e:
            raise ApiError(503, str(e)) from None
        return json_response({"flushed": True})

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        data = await json_body(request)
        rid = data.get("rid")
        if not isinstance(rid, str):
            raise ApiError(400, "give the request id to abort as {\"rid\": \"...\"}", param="rid")
        manager = server_of(request).manager
        rids = manager.in_flight_matching(rid)
        manager.abort(rids)
        return json_response({"aborted": len(rids)})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        server = server_of(request)
        try:
            server.metrics.refresh(await server.manager.control("stats", STATS_TIMEOUT_S))
        except SchedulerUnavailable:
            pass  # serve the last known gauges
        return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        server = server_of(request)
        msg, rids = _generate_msg(await json_body(request))
        items, single = prepare_generate(msg, server.model)
        rids = _request_ids(rids, len(items), single, server)
        call = server.manager.submit(items, msg.stream, rids)
        if msg.stream:
            return await stream_response(request, call, _generate_stream(call))
        events, failed = await all_results(request, call)
        if failed is not None:
            where = "" if single else f"prompt {failed.index}: "
            raise ApiError(failed.status, where + failed.error)
        results = [e.result for e in events]
        return json_response(results[0] if single else results)

    return router


async def _stats(server: ServerState) -> dict:
    try:
        return await server.manager.control("stats", STATS_TIMEOUT_S)
    except SchedulerUnavailable as e:
        raise ApiError(503, str(e)) from None


def _generate_msg(data: dict) -> tuple[GenerateMsg, Any]:
    data = dict(data)
    rids = data.pop("rid", None)
    data.pop("type", None)
    try:
        msg = GenerateMsg(rid="", **data)
    except TypeError as e:
        known = [f for f in GenerateMsg.__dataclass_fields__ if f not in ("type", "rid")]
        raise ApiError(400, f"bad /generate request ({e}); known fields: rid, {', '.join(known)}") from None
    if msg.sampling_params is None:
        msg.sampling_params = {}
    return msg, rids


def _request_ids(rids: Any, n: int, single: bool, server: ServerState) -> list[str]:
    if rids is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rids, str):
        rids = [rids] if single else [f"{rids}-{i}" for i in range(n)]
    if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) and r for r in rids):
        raise ApiError(400, f"rid must be a string or a list of {n} strings", param="rid")
    busy = [r for r in rids if server.manager.is_in_flight(r)]
    if busy or len(set(rids)) != n:
        raise ApiError(400, f"request id(s) already in flight or repeated: {busy or rids}; use new ids", param="rid")
    return rids


async def _generate_stream(call: Call) -> AsyncIterator[bytes]:
    first = True
    async for event in call:
        if event.error is not None:
            if first:  # nothing sent yet: the response gets the error's status
                raise ApiError(event.status, event.error)
            yield sse({"index": event.index, "error": error_object(event.status, event.error)})
            continue
        first = False
        yield sse({
            "index": event.index,
            "text": event.text,
            "output_ids": event.output_ids,
            "finished": event.finished,
            "meta_info": event.meta_info,
        })  # fmt: skip
    yield SSE_DONE
