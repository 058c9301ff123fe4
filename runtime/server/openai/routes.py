"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions. Bodies are
parsed by `schemas`, mapped to validated requests by `mapping` and `chat_prompt`, answered
by `views`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.server.http.common import (
    ApiError,
    ServerState,
    all_results,
    client_key,
    json_response,
    server_of,
    stream_response,
)  # fmt: skip
from spruce.runtime.server.native import batch_error
from spruce.runtime.server.openai.chat_prompt import (
    ChatPrompt,
    ToolPlan,
    chat_prompt,
    tool_plan,
)
from spruce.runtime.server.openai.mapping import (
    chat_requests,
    chat_top_logprobs,
    check_model,
    completion_requests,
    request_error,
    sampling_params,
)  # fmt: skip
from spruce.runtime.server.openai.schemas import ChatRequest, CompletionRequest, parse
from spruce.runtime.server.openai.thinking_fields import with_thinking
from spruce.runtime.server.openai.views import ChatView, CompletionView
from spruce.runtime.server.request_manager import Call, Event

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(request: Request) -> Response:
    server = server_of(request)
    card = {
        "id": server.model.name,
        "object": "model",
        "created": int(server.started),
        "owned_by": "spruce",
        "root": server.model.name,
        "max_model_len": server.model.context_length,
    }
    return json_response({"object": "list", "data": [card]})


@router.post("/completions")
async def completions(request: Request) -> Response:
    server = server_of(request)
    req: CompletionRequest = parse(CompletionRequest, await request.body())
    check_model(server, req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    items, prompts = await completion_requests(server, req)
    call = server.manager.submit(items, client=client_key(request))
    view = CompletionView(server, req, prompts, items[0].options.top_logprobs_num)
    if req.stream:
        return await stream_response(request, call, view.stream(call))
    return json_response(view.response(await chat_results(request, call)))


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    server = server_of(request)
    req: ChatRequest = parse(ChatRequest, await request.body())
    call, view = await submit_chat(request, server, req)
    if req.stream:
        return await stream_response(request, call, view.stream(call))
    return json_response(view.response(await chat_results(request, call)))


async def submit_chat(
    request: Request, server: ServerState, req: ChatRequest
) -> tuple[Call, ChatView]:
    """A parsed chat request down the one chat path: rendered, validated, submitted. The
    other APIs that chat (Anthropic Messages, Responses) map their bodies onto a
    ChatRequest and come here too; the view reads the results."""
    check_model(server, req.model)
    top = chat_top_logprobs(req)
    # rendering, tokenizing and converting tool / answer schemas take a while for big
    # requests: off the event loop (schemas also stop at their deadline, in a worker process)
    tools, prompt, base, answer_spec = await server.model.pools.convert.run(
        _chat_request, req, server
    )
    items = await chat_requests(server, prompt.ids, base, req, top)
    call = server.manager.submit(items, client=client_key(request))
    return call, ChatView(server, req, prompt, tools, answer_spec)


def _chat_request(
    req: ChatRequest, server: ServerState
) -> tuple[ToolPlan, ChatPrompt, SamplingParams, Any]:
    """(the tool plan, the rendered prompt, the sampling, the answer's own constraint spec)."""
    conversion = server.model.limits.conversion
    tools = tool_plan(req, server)
    prompt = chat_prompt(req, tools, server)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:  # OpenAI's chat default: whatever the context leaves
        max_tokens = max(server.model.context_length - len(prompt.ids), 0)
    try:
        sampling = with_thinking(sampling_params(req, max_tokens, tools.constraint), req, prompt,
                                 tools, server.options, server.model.tokenizer.chat_template)  # fmt: skip
        base, answer_spec = prompt.constrain(sampling, conversion)
    except InvalidRequestError as e:
        raise request_error(e, req) from None
    return tools, prompt, base, answer_spec


async def chat_results(request: Request, call: Call) -> list[Event]:
    """The finished events of a call; the first failure as an ApiError."""
    events = await all_results(request, call)
    failed = batch_error(events, single=True)  # choices are not prompts: no "prompt i:" prefix
    if failed is not None:
        status, message = failed
        raise ApiError(status, message)
    return events
