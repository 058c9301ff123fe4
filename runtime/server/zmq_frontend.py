"""The ZeroMQ ROUTER socket that DSL clients talk to (the protocol is protocol.py).

Each DEALER client is told apart by its ZeroMQ identity, so two clients may use the same
rids. A request is aborted when its client sends an abort, or when a reply cannot be
routed to it any more (ROUTER_MANDATORY: the client is gone).
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import zmq
import zmq.asyncio

from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.protocol import dsl as protocol
from spruce.runtime.server.native import ModelContext, batch_error, flush_cache, prepare_generate, too_large
from spruce.runtime.protocol.dsl import (
    AbortMsg,
    ChunkMsg,
    ErrorMsg,
    FinalMsg,
    FlushCacheMsg,
    GenerateMsg,
    InfoMsg,
    ModelInfoMsg,
)
from spruce.runtime.server.request_manager import Call, RequestManager

logger = logging.getLogger("spruce.server")


class ZmqFrontend:
    def __init__(self, context: zmq.asyncio.Context, address: str, max_request_bytes: int) -> None:
        """Binds at once (a port in use fails the start early); serves after `attach`, so
        messages sent while the model loads wait in the socket."""
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_request_bytes)  # beyond: the peer is dropped
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = address
        self.max_request_bytes = max_request_bytes
        self.manager: RequestManager | None = None
        self.model: ModelContext | None = None
        self.calls: dict[tuple[bytes, str], Call] = {}
        self.tasks: set[asyncio.Task] = set()
        self.accepting = True
        self.handlers = {
            GenerateMsg: self._on_generate,
            AbortMsg: self._on_abort,
            ModelInfoMsg: self._on_model_info,
            FlushCacheMsg: self._on_flush_cache,
        }

    def attach(self, manager: RequestManager, model: ModelContext) -> None:
        self.manager, self.model = manager, model

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    async def serve_forever(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:  # a DEALER sends exactly one frame per message
                logger.warning("dropped a ZeroMQ message of %d frames (expected one)", len(frames) - 1)
                continue
            self._dispatch(*frames)

    def _dispatch(self, identity: bytes, frame: bytes) -> None:
        if len(frame) > self.max_request_bytes:
            self._spawn(self._send(identity, ErrorMsg(_rid_of(frame), too_large(self.max_request_bytes), 413)))
            return
        try:
            msg = protocol.decode(frame)
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise InvalidRequestError(f"{msg.type!r} is a server message; send one of {_client_types()}")
        except InvalidRequestError as e:
            self._spawn(self._send(identity, ErrorMsg(_rid_of(frame), str(e), 400)))
            return
        self._spawn(handler(identity, msg))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- handlers ---------------------------------------------------------------------------

    async def _on_generate(self, identity: bytes, msg: GenerateMsg) -> None:
        key = (identity, msg.rid)
        error = self._refusal(key)
        try:
            items, single = prepare_generate(msg, self.model)
            if msg.stream and not single:
                raise InvalidRequestError("streaming a batch is not supported; send one request per prompt")
        except InvalidRequestError as e:
            error = error or ErrorMsg(msg.rid, str(e), 400)
        if error is not None:
            await self._send(identity, error)
            return
        base = f"z{identity.hex()}:{msg.rid}"
        rids = [base] if single else [f"{base}/{i}" for i in range(len(items))]
        call = self.manager.submit(items, rids, client_rids=[msg.rid] * len(items))
        self.calls[key] = call
        try:
            if msg.stream:
                await self._stream(identity, msg.rid, call)
            else:
                await self._reply_final(identity, msg.rid, call, single)
        finally:
            del self.calls[key]
            call.close()

    def _refusal(self, key: tuple[bytes, str]) -> ErrorMsg | None:
        if not self.accepting:
            return ErrorMsg(key[1], "the server is shutting down", 503)
        if key in self.calls:
            return ErrorMsg(key[1], f"request {key[1]!r} is already in flight; use a new rid", 400)
        return None

    async def _stream(self, identity: bytes, rid: str, call: Call) -> None:
        async for event in call:
            if event.error is not None:
                await self._send(identity, ErrorMsg(rid, event.error, event.status))
                return
            if event.text or event.output_ids:
                await self._send(identity, ChunkMsg(rid, event.text, event.output_ids, event.meta_info))
            if event.finished:
                await self._send(identity, FinalMsg(rid, **event.result))

    async def _reply_final(self, identity: bytes, rid: str, call: Call, single: bool) -> None:
        events = await call.results()
        failed = batch_error(events, single)
        if failed is not None:
            status, message = failed
            await self._send(identity, ErrorMsg(rid, message, status))
        elif single:
            await self._send(identity, FinalMsg(rid, **events[0].result))
        else:
            await self._send(identity, FinalMsg(rid, results=[e.result for e in events]))

    async def _on_abort(self, identity: bytes, msg: AbortMsg) -> None:
        call = self.calls.get((identity, msg.rid))
        if call is not None:
            call.close("aborted by the client")

    async def _on_model_info(self, identity: bytes, msg: ModelInfoMsg) -> None:
        await self._send(identity, InfoMsg(msg.rid, self.model.info()))

    async def _on_flush_cache(self, identity: bytes, msg: FlushCacheMsg) -> None:
        refused = await flush_cache(self.manager)
        if refused is not None:
            status, message = refused
            await self._send(identity, ErrorMsg(msg.rid, message, status))
        else:
            await self._send(identity, InfoMsg(msg.rid, {"flushed": True}))

    # -- sending ----------------------------------------------------------------------------

    async def _send(self, identity: bytes, msg) -> None:
        try:
            await self.socket.send_multipart([identity, protocol.encode(msg)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._client_gone(identity)

    def _client_gone(self, identity: bytes) -> None:
        for (who, _), call in list(self.calls.items()):
            if who == identity:
                call.close("the ZeroMQ client is gone")

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.socket.close(linger=0)


def _rid_of(frame: bytes) -> str:
    """The rid of a message that could not be decoded, if it has one (for the error reply)."""
    try:
        data = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return ""
    rid = data.get("rid") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) else ""


def _client_types() -> str:
    return "generate, abort, model_info, flush_cache"
