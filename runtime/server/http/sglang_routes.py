"""The route names SGLang's clients call, on top of the native routes (whose handlers they
reuse): /get_model_info, /get_server_info, /health_generate, /abort_request with
{"abort_all": true}, and /v1/tokenize, /v1/detokenize (also without /v1, as SGLang serves
them). SGLang's GET /flush_cache is not served: a route that changes state is POST only
(a GET gets 405), so that no link or image tag in a web page can call it.

Included before the native router, so that POST /abort_request reaches `abort_request`
here first: it handles abort_all and hands anything else to the native handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from spruce.runtime.server.http.common import (
    ApiError,
    error_response,
    json_body,
    json_response,
    server_of,
)
from spruce.runtime.server.http.native_routes import native_routes

HEALTH_PROMPT = "Hi"  # /health_generate decodes one token after it


def sglang_routes() -> APIRouter:
    native = _native_handlers()
    router = APIRouter()
    router.add_api_route("/get_model_info", native["GET /model_info"], methods=["GET"])
    router.add_api_route("/get_server_info", native["GET /server_info"], methods=["GET"])

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """Healthy when the model generates one token (SGLang's deeper health check)."""
        body = {"text": HEALTH_PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        try:
            await native["POST /generate"](_with_body(request, body))
        except ApiError as e:
            return error_response(503, f"the model did not generate a token: {e.message}")
        return json_response({"status": "ok"})

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """{"abort_all": true} aborts every request in flight; else the native handler."""
        data = await json_body(request)
        abort_all = data.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise ApiError(400, "abort_all must be true or false", param="abort_all")
        if not abort_all:
            return await native["POST /abort_request"](request)
        return json_response(
            {"aborted": server_of(request).manager.abort_all("aborted by the client (abort_all)")}
        )

    for path in ("/v1/tokenize", "/tokenize"):
        router.add_api_route(path, tokenize, methods=["POST"])
    for path in ("/v1/detokenize", "/detokenize"):
        router.add_api_route(path, detokenize, methods=["POST"])
    return router


async def tokenize(request: Request) -> Response:
    """{"prompt": str | [str], "add_special_tokens": bool} -> {"tokens", "count", "max_model_len"}."""
    data = await json_body(request)
    prompt, add_special = data.get("prompt"), data.get("add_special_tokens", True)
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ApiError(400, "prompt must be a string or a list of strings", param="prompt")
    if not isinstance(add_special, bool):
        raise ApiError(400, "add_special_tokens must be true or false", param="add_special_tokens")
    model = server_of(request).model
    limit = model.limits.request.max_tokenize_chars
    chars = sum(len(p) for p in prompts)
    if chars > limit:
        raise ApiError(
            400,
            f"prompt has {chars} characters; the limit is {limit} (--max-tokenize-chars)",
            param="prompt",
        )
    tokens = await model.pools.tokenize.run(_encode_all, model.tokenizer, prompts, add_special)
    counts = [len(t) for t in tokens]
    single = not isinstance(prompt, list)
    return json_response({
        "tokens": tokens[0] if single else tokens,
        "count": counts[0] if single else counts,
        "max_model_len": model.context_length,
    })  # fmt: skip


async def detokenize(request: Request) -> Response:
    """{"tokens": [int] | [[int]]} -> {"text": str | [str]}."""
    data = await json_body(request)
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(
            400, "tokens must be a list of token ids or a list of such lists", param="tokens"
        )
    model = server_of(request).model
    limit = model.limits.request.max_detokenize_ids
    count = sum(len(t) if isinstance(t, list) else 1 for t in tokens)
    if count > limit:
        raise ApiError(
            400,
            f"tokens has {count} token ids; the limit is {limit} (--max-detokenize-ids)",
            param="tokens",
        )
    single, texts = await model.pools.tokenize.run(_decode_all, model, tokens)
    return json_response({"text": texts[0] if single else texts})


def _encode_all(tokenizer, prompts: list[str], add_special: bool) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=add_special) for p in prompts]


def _decode_all(model, tokens: list) -> tuple[bool, list[str]]:
    """(whether `tokens` was one list of ids, the texts); ApiError names what is wrong."""
    single = all(_is_token(t) for t in tokens)
    batch = [tokens] if single else tokens
    if not all(isinstance(b, list) and all(_is_token(t) for t in b) for b in batch):
        raise ApiError(
            400, "tokens must be a list of token ids or a list of such lists", param="tokens"
        )
    vocab = model.limits.vocab_size
    if any(t >= vocab for b in batch for t in b):
        raise ApiError(400, f"token ids must be below the vocabulary size {vocab}", param="tokens")
    return single, [model.tokenizer.decode(b) for b in batch]


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _native_handlers() -> dict[str, Callable]:
    """ "METHOD /path" -> the native route's handler."""
    return {
        f"{method} {route.path}": route.endpoint
        for route in native_routes().routes
        for method in route.methods
    }


def _with_body(request: Request, body: dict) -> Request:
    """A request like `request` whose body is `body` (then the client's own events, so a
    disconnect is still seen)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": orjson.dumps(body), "more_body": False}
        return await request.receive()

    return Request({**request.scope, "method": "POST"}, receive)
