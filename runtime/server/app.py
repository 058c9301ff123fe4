"""The HTTP API as one FastAPI app: the native routes (server/http) and the OpenAI-compatible
routes (server/openai), behind the GuardMiddleware that the launcher installs first."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from spruce.runtime.errors import INTERNAL_ERROR, InvalidRequestError
from spruce.runtime.protocol.ipc import Ready
from spruce.runtime.server.anthropic.routes import router as anthropic_router
from spruce.runtime.server.embeddings import embedding_routes
from spruce.runtime.server.http.common import (
    ApiError,
    ServerState,
    error_response,
    first_param,
    server_of,
    validation_message,
)
from spruce.runtime.server.http.native_routes import native_routes
from spruce.runtime.server.http.sglang_routes import sglang_routes
from spruce.runtime.server.metrics import Metrics
from spruce.runtime.server.native import ModelContext
from spruce.runtime.server.openai.responses import router as responses_router
from spruce.runtime.server.openai.routes import router as openai_router
from spruce.runtime.server.request_manager import Refused

logger = logging.getLogger("spruce.server")


def build_app(launcher, model: ModelContext, metrics: Metrics, ready: Ready) -> FastAPI:
    app = FastAPI(title="Spruce", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(launcher, model, metrics, ready)
    app.include_router(sglang_routes())  # SGLang's route names; first: it wraps POST /abort_request
    app.include_router(native_routes())
    app.include_router(embedding_routes())  # /v1/embeddings, /encode
    app.include_router(openai_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)  # POST /v1/responses
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(Refused)
    async def _refused(request: Request, e: Refused) -> Response:
        response = error_response(e.status, e.message)
        if e.retry_after_s is not None:
            server_of(request).metrics.refused.labels(str(e.status)).inc()
            response.headers["Retry-After"] = str(e.retry_after_s)
        return response

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError) -> Response:
        return error_response(400, str(e), param=e.field)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return error_response(400, validation_message(e.errors()), param=first_param(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        response = error_response(e.status_code, _http_message(request, e))
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, INTERNAL_ERROR)


def _http_message(request: Request, e: StarletteHTTPException) -> str:
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}"
    if e.status_code == 404:
        return f"no route {request.url.path}"
    return str(e.detail)
