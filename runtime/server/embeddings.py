"""Embeddings over HTTP: OpenAI's `POST /v1/embeddings` and SGLang's native `POST /encode`.

Each maps its body onto one embedding `Draft` (the prompts, nothing to generate) and the
one validator; the requests run through the scheduler like any prompt (batched, chunked,
sharing the prefix cache under last-token pooling), and each answer is the prompt's pooled
final hidden state (engine/pooling.py), truncated to `dimensions` and scaled to unit length.
`encoding_format: "base64"` sends the little-endian float32 bytes, as OpenAI does (the
openai client asks for it by default).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response

from spruce.runtime.core.update import finish_vector
from spruce.runtime.core.validation import Draft
from spruce.runtime.errors import FieldNames, InvalidRequestError
from spruce.runtime.server.http.common import (
    ApiError,
    all_results,
    client_key,
    json_body,
    json_response,
    server_of,
)
from spruce.runtime.server.native import NATIVE_NAMES, batch_error
from spruce.runtime.server.openai.mapping import check_model
from spruce.runtime.server.openai.schemas import StrictModel, parse
from spruce.runtime.server.request_manager import Event

OPENAI_NAMES = FieldNames({"text": "input", "input_ids": "input", "prompt": "input"})


class EmbeddingRequest(StrictModel):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted; changes nothing


def embedding_routes() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        server = server_of(request)
        req: EmbeddingRequest = parse(EmbeddingRequest, await request.body())
        check_model(server, req.model)
        text, ids = _openai_input(req.input)
        draft = Draft(text, ids, {"max_new_tokens": 0}, embed=True, dimensions=req.dimensions)
        events, _ = await _embed(request, draft, OPENAI_NAMES)
        data = [
            {"object": "embedding", "index": e.index, "embedding": _encoded(e, req)}
            for e in events
        ]  # fmt: skip
        tokens = sum(e.result["meta_info"]["prompt_tokens"] for e in events)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return json_response({"object": "list", "data": data, "model": req.model, "usage": usage})

    @router.post("/encode")
    async def encode(request: Request) -> Response:
        body = await json_body(request)
        unknown = sorted(set(body) - {"text", "input_ids", "dimensions", "rid"})
        if unknown:
            raise ApiError(
                400,
                f"unknown field(s) {unknown}; /encode takes text or input_ids, and dimensions",
                param=unknown[0],
            )
        dimensions = body.get("dimensions")
        draft = Draft(body.get("text"), body.get("input_ids"), {"max_new_tokens": 0}, embed=True,
                      dimensions=dimensions)  # fmt: skip
        events, single = await _embed(request, draft, NATIVE_NAMES)
        results = [
            {"embedding": finish_vector(e.result["embedding"], dimensions), "meta_info": e.result["meta_info"]}
            for e in events
        ]  # fmt: skip
        return json_response(results[0] if single else results)

    return router


async def _embed(request: Request, draft: Draft, names: FieldNames) -> tuple[list[Event], bool]:
    """The call validated, run, and its events (the first failure as an ApiError)."""
    server = server_of(request)
    try:
        call = await server.model.validate(draft, names)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=names(e.field) if e.field else None) from None
    running = server.manager.submit(call.requests, client=client_key(request))
    events = await all_results(request, running)
    failed = batch_error(events, call.single)
    if failed is not None:
        raise ApiError(*failed)
    return events, call.single


def _openai_input(value: Any) -> tuple[Any, Any]:
    """(text, input_ids) of OpenAI's `input`: a string, strings, token ids or lists of them."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], str)):
        return value, None
    return None, value


def _encoded(event: Event, req: EmbeddingRequest) -> list[float] | str:
    vector = finish_vector(event.result["embedding"], req.dimensions)
    if req.encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
