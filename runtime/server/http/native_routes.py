"""The native HTTP routes: /generate, /model_info, /server_info, /flush_cache,
/abort_request, /health, /ready, /metrics.

/health is liveness: 200 while the scheduler's loop turns (its latest heartbeat is younger
than --scheduler-timeout-s), however busy; read from the front end's own record, with no
round trip that would wait behind a long step. /ready is readiness: 503 while the server
would refuse a new request (its queue is full), or is not live. Both bodies carry the
numbers (heartbeat age, requests in flight)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from spruce.runtime.protocol.dsl import GenerateMsg
from spruce.runtime.server.http.common import (
    SSE_DONE,
    ApiError,
    ServerState,
    all_results,
    client_key,
    error_body,
    error_response,
    json_body,
    json_response,
    server_of,
    sse,
    stream_error,
    stream_response,
)  # fmt: skip
from spruce.runtime.server.native import (
    batch_error,
    flush_cache,
    prepare_generate,
    present_meta,
    present_result,
)
from spruce.runtime.server.request_manager import Call, SchedulerUnavailable

STATS_TIMEOUT_S = 5.0
HTTP_RID_PREFIX = "h:"  # native HTTP rids run as "h:<rid>" (ZeroMQ's as "z<identity>:<rid>")


def native_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        server = server_of(request)
        if server.draining:
            return error_response(503, "the server is shutting down")
        problem = server.launcher.supervisor.problem()
        if problem is not None:
            return error_response(503, problem)
        problem, body = server.manager.liveness()
        saturated, _ = server.manager.readiness()
        return _probe(problem, dict(body, ready=saturated is None))

    @router.get("/ready")
    async def ready(request: Request) -> Response:
        server = server_of(request)
        problem, body = server.manager.readiness()
        if server.draining:
            problem = "the server is shutting down"
        return _probe(problem, body)

    @router.get("/model_info")
    async def model_info(request: Request) -> Response:
        return json_response(server_of(request).model.info())

    @router.get("/server_info")
    async def server_info(request: Request) -> Response:
        server = server_of(request)
        stats = await _stats(server)
        return json_response({
            "model": server.model.info(),
            "model_path": server.model.path,
            "engine_config": server.ready.config,
            "server_options": server.options.to_dict(),
            "kv_slots_total": server.ready.kv_slots,
            "in_flight_requests": server.in_flight(),
            "scheduler": stats,
            "replicas": _replicas(server),
        })  # fmt: skip

    @router.post("/flush_cache")
    async def flush(request: Request) -> Response:
        refused = await flush_cache(server_of(request).manager)
        if refused is not None:
            raise ApiError(*refused)
        return json_response({"flushed": True})

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        data = await json_body(request)
        rid = data.get("rid")
        if not isinstance(rid, str):
            raise ApiError(400, 'give the request id to abort as {"rid": "..."}', param="rid")
        manager = server_of(request).manager
        rids = manager.in_flight_matching(HTTP_RID_PREFIX + rid)
        manager.abort(rids)
        return json_response({"aborted": len(rids)})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        server = server_of(request)
        server.metrics.refresh_liveness(server.manager.replicas.all)
        try:
            server.metrics.refresh(await server.manager.control("stats", STATS_TIMEOUT_S))
        except SchedulerUnavailable:
            pass  # serve the last known gauges
        return Response(
            server.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        server = server_of(request)
        msg, rids = _generate_msg(await json_body(request))
        items, single = await prepare_generate(msg, server.model)
        client_rids = _request_ids(rids, len(items), single)
        rids = [HTTP_RID_PREFIX + r for r in client_rids]  # apart from ZeroMQ clients' rids
        call = server.manager.submit(items, rids, client_rids, client=client_key(request))
        shown = (items[0].options, server.model)  # how results are shown (return_text_in_logprobs)
        if msg.stream:
            return await stream_response(
                request, call, _generate_stream(call, lambda m: present_meta(m, *shown))
            )
        events = await all_results(request, call)
        failed = batch_error(events, single)
        if failed is not None:
            raise ApiError(*failed)
        results = [present_result(e.result, *shown) for e in events]
        return json_response(results[0] if single else results)

    return router


def _probe(problem: str | None, body: dict) -> Response:
    """200 with the numbers, or 503 saying why, with the numbers."""
    if problem is None:
        return json_response({"status": "ok", **body})
    return json_response({**orjson.loads(error_body(503, problem)), **body}, 503)


def _replicas(server: ServerState) -> list[dict]:
    """Each scheduler replica (--dp): its pid, whether it is alive, its load."""
    pids = [p.pid for p in server.launcher.schedulers]
    return [dict(r.info(), pid=pid) for r, pid in zip(server.manager.replicas.all, pids)]


async def _stats(server: ServerState) -> dict:
    try:
        return await server.manager.control("stats", STATS_TIMEOUT_S)
    except SchedulerUnavailable as e:
        raise ApiError(503, str(e)) from None


def _generate_msg(data: dict) -> tuple[GenerateMsg, Any]:
    data = dict(data)
    rids = data.pop("rid", None)
    data.pop("type", None)
    known = [f for f in GenerateMsg.__dataclass_fields__ if f not in ("type", "rid")]
    unknown = sorted(set(data) - set(known))
    if unknown:
        shown = [name[:64] for name in unknown[:5]]
        raise ApiError(
            400, f"unknown field(s) {shown} in /generate; known: rid, {', '.join(known)}"
        )
    msg = GenerateMsg(rid="", **data)
    if msg.sampling_params is None:
        msg.sampling_params = {}
    return msg, rids


def _request_ids(rids: Any, n: int, single: bool) -> list[str]:
    if rids is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rids, str):
        rids = [rids] if single else [f"{rids}-{i}" for i in range(n)]
    if (
        not isinstance(rids, list)
        or len(rids) != n
        or not all(isinstance(r, str) and r for r in rids)
    ):
        raise ApiError(400, f"rid must be a string or a list of {n} strings", param="rid")
    return rids


async def _generate_stream(call: Call, present: Callable[[dict], dict]) -> AsyncIterator[bytes]:
    first = True
    async for event in call:
        if event.error is not None:
            yield stream_error(event, nothing_sent=first)
            continue
        first = False
        yield sse({
            "index": event.index,
            "text": event.text,
            "output_ids": event.output_ids,
            "finished": event.finished,
            "meta_info": present(event.meta_info),
        })  # fmt: skip
    yield SSE_DONE
