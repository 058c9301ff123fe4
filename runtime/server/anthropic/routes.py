"""Anthropic Messages routes: POST /v1/messages and /v1/messages/count_tokens. A body is
parsed (`schemas`), mapped onto a ChatRequest (`mapping`) and sent down the one chat path
(openai/routes.py submit_chat); `views` answers in Anthropic's shapes, errors included."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spruce.runtime.errors import INTERNAL_ERROR, InvalidRequestError
from spruce.runtime.server.anthropic.mapping import chat_request, renamed
from spruce.runtime.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from spruce.runtime.server.anthropic.views import MessageView, error_object
from spruce.runtime.server.http.common import (
    ApiError,
    ServerState,
    json_response,
    server_of,
    stream_response,
)  # fmt: skip
from spruce.runtime.server.openai.chat_prompt import chat_prompt, tool_plan
from spruce.runtime.server.openai.mapping import check_model
from spruce.runtime.server.openai.routes import chat_results, submit_chat
from spruce.runtime.server.openai.schemas import ChatRequest, parse
from spruce.runtime.server.request_manager import Refused

logger = logging.getLogger("spruce.server")
router = APIRouter(prefix="/v1")


@router.post("/messages")
async def messages(request: Request) -> Response:
    return await answered(request, _messages)


@router.post("/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    return await answered(request, _count_tokens)


async def _messages(request: Request) -> Response:
    server = server_of(request)
    req: MessagesRequest = parse(MessagesRequest, await request.body())
    call, chat = await submit_chat(request, server, chat_request(req))
    view = MessageView(req, chat)
    if req.stream:
        return await stream_response(request, call, view.stream(call))
    [event] = await chat_results(request, call)
    return json_response(view.message(event))


async def _count_tokens(request: Request) -> Response:
    """The prompt's tokens as /v1/messages renders it (tools as tool_choice shows them)."""
    server = server_of(request)
    req = chat_request(parse(CountTokensRequest, await request.body()))
    check_model(server, req.model)
    count = await server.model.pools.convert.run(prompt_tokens, req, server)
    return json_response({"input_tokens": count})


def prompt_tokens(req: ChatRequest, server: ServerState) -> int:
    tools = tool_plan(req, server)
    return len(chat_prompt(req, tools, server).ids)


async def answered(request: Request, route: Callable[[Request], Awaitable[Response]]) -> Response:
    """The route's response, or its error as Anthropic's error object with its status."""
    try:
        return await route(request)
    except ApiError as e:
        e = renamed(e)
        return error_response(e.status, e.message)
    except InvalidRequestError as e:
        return error_response(400, str(e))
    except Refused as e:
        response = error_response(e.status, e.message)
        if e.retry_after_s is not None:
            server_of(request).metrics.refused.labels(str(e.status)).inc()
            response.headers["Retry-After"] = str(e.retry_after_s)
        return response
    except Exception:
        logger.exception("internal error on %s", request.url.path)
        return error_response(500, INTERNAL_ERROR)


def error_response(status: int, message: str) -> Response:
    return json_response(error_object(status, message), status)
