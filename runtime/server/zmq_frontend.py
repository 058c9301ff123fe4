"""The ZeroMQ ROUTER socket that DSL clients talk to (the protocol is protocol/dsl.py).

Each DEALER client is told apart by its ZeroMQ identity: its rids run in the scheduler as
"z<identity>:<rid>", so two clients may use the same rids. A request is aborted when its
client sends an abort, or when a reply cannot be routed to it any more (ROUTER_MANDATORY:
the client is gone).

Nothing a client sends can stop this socket: every frame is decoded defensively (a
malformed one gets an error reply when its rid can be read, else it is dropped; both are
counted in /metrics), every handler runs in a task that turns an unexpected exception into
a 500 error for that request only, and the launcher restarts `serve_forever` if it ever
fails (server/supervisor.py). With an API key every message must carry it (401 otherwise).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import zmq
import zmq.asyncio
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.protocol import dsl as protocol
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
from spruce.runtime.server.metrics import Metrics
from spruce.runtime.server.native import (
    ModelContext,
    batch_error,
    flush_cache,
    prepare_generate,
    present_meta,
    present_result,
    too_large,
)
from spruce.runtime.server.request_manager import Call, Refused, RequestManager

logger = logging.getLogger("spruce.server")
SEND_TIMEOUT_S = 10.0  # a reply the client's full queue does not take in this time: the client is gone


class ZmqFrontend:
    def __init__(
        self, context: zmq.asyncio.Context, address: str, max_request_bytes: int, api_key: str | None = None
    ) -> None:
        """Binds at once (a port in use fails the start early); serves after `attach`, so
        messages sent while the model loads wait in the socket."""
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_request_bytes)  # beyond: the peer is dropped
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = address
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key.encode() if api_key else None
        self.manager: RequestManager | None = None
        self.model: ModelContext | None = None
        self.metrics: Metrics | None = None
        self.calls: dict[tuple[bytes, str], Call] = {}
        self.tasks: set[asyncio.Task] = set()
        self.accepting = True
        self.handlers = {
            GenerateMsg: self._on_generate,
            AbortMsg: self._on_abort,
            ModelInfoMsg: self._on_model_info,
            FlushCacheMsg: self._on_flush_cache,
        }

    def attach(self, manager: RequestManager, model: ModelContext, metrics: Metrics) -> None:
        self.manager, self.model, self.metrics = manager, model, metrics

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    async def serve_forever(self) -> None:
        while True:
            frames = await self.socket.recv_multipart()
            if len(frames) != 2:  # a DEALER sends exactly one frame per message
                self._bad_frame(None, f"a ZeroMQ message of {len(frames) - 1} frames (expected one)")
                continue
            try:
                self._dispatch(*frames)
            except Exception:  # a bug, not the client's doing: logged, and the socket serves on
                logger.exception("the ZeroMQ front end failed on a message; it serves on")

    def _dispatch(self, identity: bytes, frame: bytes) -> None:
        if len(frame) > self.max_request_bytes:
            self._bad_frame(identity, too_large(self.max_request_bytes), protocol.rid_of(frame), 413)
            return
        try:
            msg, key = protocol.decode_request(frame)
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise InvalidRequestError(f"{msg.type!r} is a server message; send one of {_client_types()}")
        except InvalidRequestError as e:
            self._bad_frame(identity, str(e), protocol.rid_of(frame))
            return
        if not self._authorized(key):
            message = "missing or wrong API key: send the server's --api-key as the message's \"api_key\""
            self._spawn(self._send(identity, ErrorMsg(msg.rid, message, 401)))
            return
        self._spawn(handler(identity, msg))

    def _authorized(self, key: str | None) -> bool:
        if self.api_key is None:
            return True
        return key is not None and hmac.compare_digest(key.encode(), self.api_key)

    def _bad_frame(self, identity: bytes | None, message: str, rid: str | None = None, status: int = 400) -> None:
        """A frame that is not a valid message: an error reply if it has a rid, else dropped."""
        answered = identity is not None and rid is not None
        if self.metrics is not None:
            self.metrics.zmq_bad_frames.labels("answered" if answered else "dropped").inc()
        if answered:
            self._spawn(self._send(identity, ErrorMsg(rid, message, status)))
        else:
            logger.warning("dropped a ZeroMQ frame: %s", message)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a ZeroMQ handler failed", exc_info=task.exception())

    # -- handlers ---------------------------------------------------------------------------

    async def _on_generate(self, identity: bytes, msg: GenerateMsg) -> None:
        try:
            call, single, options = await self._submit(identity, msg)
        except Refused as e:
            if e.retry_after_s is not None:
                self.metrics.refused.labels(str(e.status)).inc()
            await self._send(identity, ErrorMsg(msg.rid, e.message, e.status))
            return
        except Exception as e:  # a bug, not the client's doing: its own 500, the socket serves on
            logger.exception("internal error on a ZeroMQ generate")
            await self._send(identity, ErrorMsg(msg.rid, f"internal server error: {type(e).__name__}", 500))
            return
        key = (identity, msg.rid)
        self.calls[key] = call
        try:
            if msg.stream:
                await self._stream(identity, msg.rid, call, options)
            else:
                await self._reply_final(identity, msg.rid, call, single, options)
        finally:
            del self.calls[key]
            call.close()

    async def _submit(self, identity: bytes, msg: GenerateMsg) -> tuple[Call, bool, RequestOptions]:
        """Validates and submits; raises Refused saying why not."""
        if not self.accepting:
            raise Refused(503, "the server is shutting down")
        if (identity, msg.rid) in self.calls:
            raise Refused(400, f"request {msg.rid!r} is already in flight; use a new rid")
        try:
            items, single = await prepare_generate(msg, self.model)
            if msg.stream and not single:
                raise InvalidRequestError("streaming a batch is not supported; send one request per prompt")
        except InvalidRequestError as e:
            raise Refused(400, str(e)) from None
        client = f"z{identity.hex()}"
        base = f"{client}:{msg.rid}"
        rids = [base] if single else [f"{base}/{i}" for i in range(len(items))]
        call = self.manager.submit(items, rids, client_rids=[msg.rid] * len(items), client=client)
        return call, single, items[0].options

    async def _stream(self, identity: bytes, rid: str, call: Call, options: RequestOptions) -> None:
        async for event in call:
            if event.error is not None:
                await self._send(identity, ErrorMsg(rid, event.error, event.status))
                return
            chunk = ChunkMsg(rid, event.text, event.output_ids, present_meta(event.meta_info, options, self.model))
            if (event.text or event.output_ids) and not await self._send(identity, chunk):
                return  # the client is gone: its call is closed, nothing more to send
            if event.finished:
                await self._send(identity, FinalMsg(rid, **present_result(event.result, options, self.model)))

    async def _reply_final(self, identity: bytes, rid: str, call: Call, single: bool, options: RequestOptions) -> None:
        events = await call.results()
        failed = batch_error(events, single)
        if failed is not None:
            status, message = failed
            await self._send(identity, ErrorMsg(rid, message, status))
        elif single:
            await self._send(identity, FinalMsg(rid, **present_result(events[0].result, options, self.model)))
        else:
            results = [present_result(e.result, options, self.model) for e in events]
            await self._send(identity, FinalMsg(rid, results=results))

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

    async def _send(self, identity: bytes, msg) -> bool:
        """Sends one reply; False when the client is gone. A client that leaves more than
        the socket's high-water mark of replies unread for SEND_TIMEOUT_S counts as gone
        (its requests are aborted)."""
        try:
            await asyncio.wait_for(self.socket.send_multipart([identity, protocol.encode(msg)]), SEND_TIMEOUT_S)
            return True
        except asyncio.TimeoutError:
            self._client_gone(identity, "the ZeroMQ client does not read its replies")
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._client_gone(identity)
        return False

    def _client_gone(self, identity: bytes, message: str = "the ZeroMQ client is gone") -> None:
        for (who, _), call in list(self.calls.items()):
            if who == identity:
                call.close(message)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.socket.close(linger=0)


def _client_types() -> str:
    return ", ".join(protocol.CLIENT_TYPES)
