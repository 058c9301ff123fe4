"""The ZeroMQ ROUTER socket that DSL clients talk to (the protocol is protocol/dsl.py).

Each DEALER client is told apart by its ZeroMQ identity: its rids run in the scheduler as
"z<identity>:<rid>", so two clients may use the same rids. A request is aborted when its
client sends an abort, or when a reply cannot be routed to it any more (ROUTER_MANDATORY:
the client is gone).

Nothing a client sends can stop this socket. A message is an envelope (rid, API key, body:
protocol/dsl.py): the key is checked, then the body's size and the client's byte budget,
before the body is read at all, so a client without the key costs a bounded queue and a
comparison. Bodies are decoded defensively (a malformed one gets an error reply when its
rid is known, else it is dropped; all are counted in /metrics), every handler runs in a
task that turns an unexpected exception into a 500 error for that request only, and the
launcher restarts `serve_forever` if it ever fails (server/supervisor.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import zmq
import zmq.asyncio

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.errors import INTERNAL_ERROR, InvalidRequestError
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
SEND_TIMEOUT_S = (
    10.0  # a reply the client's full queue does not take in this time: the client is gone
)
ROUTER_RCVHWM = 16  # messages queued per client before its sends wait (libzmq's default: 1,000)
UNAUTHORIZED = "missing or wrong API key: send the server's --api-key in the message envelope (protocol/dsl.py)"


class ZmqFrontend:
    def __init__(
        self, context: zmq.asyncio.Context, address: str, max_request_bytes: int, api_key: str | None = None,
        max_bytes_per_client: int | None = None,
    ) -> None:  # fmt: skip
        """Binds at once (a port in use fails the start early); serves after `attach`, so
        messages sent while the model loads wait in the socket."""
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_request_bytes)  # beyond: the peer is dropped
        self.socket.setsockopt(zmq.RCVHWM, ROUTER_RCVHWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.address = address
        self.max_request_bytes = max_request_bytes
        self.max_bytes_per_client = max_bytes_per_client or 4 * max_request_bytes
        self.api_key = api_key.encode() if api_key else None
        self.manager: RequestManager | None = None
        self.model: ModelContext | None = None
        self.metrics: Metrics | None = None
        self.calls: dict[tuple[bytes, str], Call] = {}
        self.claimed: set[tuple[bytes, str]] = (
            set()
        )  # (identity, rid) of every generate being handled
        self.bytes_in_flight: dict[
            bytes, int
        ] = {}  # per identity: the sizes of messages being handled
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
            identity, *parts = await self.socket.recv_multipart()
            try:
                self._dispatch(identity, parts)
            except Exception:  # a bug, not the client's doing: logged, and the socket serves on
                logger.exception("the ZeroMQ front end failed on a message; it serves on")

    def _dispatch(self, identity: bytes, parts: list[bytes]) -> None:
        if len(parts) == 3:
            self._on_envelope(identity, *parts)
        elif len(parts) == 1:
            self._on_bare(identity, parts[0])
        else:
            self._bad_frame(
                None, f"a ZeroMQ message of {len(parts)} frames (expected 3: rid, api_key, body)"
            )

    def _on_envelope(self, identity: bytes, rid_frame: bytes, key: bytes, body: bytes) -> None:
        """Checks in order of cost; the body is read only once the rest has passed."""
        rid = protocol.envelope_rid(rid_frame)
        if rid is None:
            self._bad_frame(None, "an envelope whose rid frame is not a short UTF-8 string")
        elif self.api_key is not None and not hmac.compare_digest(key, self.api_key):
            self._unauthorized(identity, rid)
        elif len(body) > self.max_request_bytes:
            self._bad_frame(identity, too_large(self.max_request_bytes), rid, 413)
        elif self._over_budget(identity, len(body)):
            message = f"more than {self.max_bytes_per_client} bytes of messages in flight (--max-zmq-bytes-per-client)"
            self._bad_frame(identity, message, rid, 429)
        else:
            self._handle(identity, body, rid)

    def _on_bare(self, identity: bytes, body: bytes) -> None:
        """A body without an envelope: only a server without an API key takes it."""
        if self.api_key is not None:
            self._unauthorized(identity, "")
        elif len(body) > self.max_request_bytes:
            self._bad_frame(None, too_large(self.max_request_bytes))  # its rid is not read: dropped
        elif self._over_budget(identity, len(body)):
            self._bad_frame(None, "a client over its --max-zmq-bytes-per-client")
        else:
            self._handle(identity, body, None)

    def _handle(self, identity: bytes, body: bytes, rid: str | None) -> None:
        try:
            msg = protocol.decode(body)
            if rid is not None and msg.rid != rid:
                raise InvalidRequestError("the body's rid differs from the envelope's")
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise InvalidRequestError(
                    f"{msg.type!r} is a server message; send one of {_client_types()}"
                )
        except InvalidRequestError as e:
            self._bad_frame(identity, str(e), protocol.rid_of(body) if rid is None else rid)
            return
        self._spawn(handler(identity, msg), identity, len(body))

    def _over_budget(self, identity: bytes, size: int) -> bool:
        held = self.bytes_in_flight.get(identity, 0)
        return held > 0 and held + size > self.max_bytes_per_client

    def _unauthorized(self, identity: bytes, rid: str) -> None:
        """Answered only if the client's queue takes it now: nothing waits on such a client."""
        if self.metrics is not None:
            self.metrics.zmq_bad_frames.labels("unauthorized").inc()
        future = self.socket.send_multipart(
            [identity, protocol.encode(ErrorMsg(rid, UNAUTHORIZED, 401))], zmq.NOBLOCK
        )
        future.add_done_callback(_ignore_outcome)

    def _bad_frame(
        self, identity: bytes | None, message: str, rid: str | None = None, status: int = 400
    ) -> None:
        """A message that is not valid: an error reply if it has a rid, else dropped."""
        answered = identity is not None and bool(rid)
        if self.metrics is not None:
            self.metrics.zmq_bad_frames.labels("answered" if answered else "dropped").inc()
        if answered:
            self._spawn(self._send(identity, ErrorMsg(rid, message, status)))
        else:
            logger.warning("dropped a ZeroMQ message: %s", message)

    def _spawn(self, coro, identity: bytes = b"", size: int = 0) -> None:
        """Runs a handler; `size` bytes count against `identity`'s budget until it ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        if size:
            self.bytes_in_flight[identity] = self.bytes_in_flight.get(identity, 0) + size
        task.add_done_callback(lambda t: self._task_done(t, identity, size))

    def _task_done(self, task: asyncio.Task, identity: bytes, size: int) -> None:
        self.tasks.discard(task)
        if size:
            left = self.bytes_in_flight.pop(identity) - size
            if left:
                self.bytes_in_flight[identity] = left
        if not task.cancelled() and task.exception() is not None:
            logger.error("a ZeroMQ handler failed", exc_info=task.exception())

    # -- handlers ---------------------------------------------------------------------------

    async def _on_generate(self, identity: bytes, msg: GenerateMsg) -> None:
        key = (identity, msg.rid)
        if key in self.claimed:  # claimed before any await: a single and a batch may share no rid
            await self._send(
                identity,
                ErrorMsg(msg.rid, f"request {msg.rid!r} is already in flight; use a new rid", 400),
            )
            return
        self.claimed.add(key)
        try:
            await self._run_generate(identity, msg)
        finally:
            self.claimed.discard(key)

    async def _run_generate(self, identity: bytes, msg: GenerateMsg) -> None:
        try:
            call, single, options = await self._submit(identity, msg)
        except Refused as e:
            if e.retry_after_s is not None:
                self.metrics.refused.labels(str(e.status)).inc()
            await self._send(identity, ErrorMsg(msg.rid, e.message, e.status))
            return
        except Exception:  # a bug, not the client's doing: its own 500, the socket serves on
            logger.exception("internal error on a ZeroMQ generate")
            await self._send(identity, ErrorMsg(msg.rid, INTERNAL_ERROR, 500))
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
        try:
            items, single = await prepare_generate(msg, self.model)
            if msg.stream and not single:
                raise InvalidRequestError(
                    "streaming a batch is not supported; send one request per prompt"
                )
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
            chunk = ChunkMsg(
                rid,
                event.text,
                event.output_ids,
                present_meta(event.meta_info, options, self.model),
            )
            if (event.text or event.output_ids) and not await self._send(identity, chunk):
                return  # the client is gone: its call is closed, nothing more to send
            if event.finished:
                await self._send(
                    identity, FinalMsg(rid, **present_result(event.result, options, self.model))
                )

    async def _reply_final(
        self, identity: bytes, rid: str, call: Call, single: bool, options: RequestOptions
    ) -> None:
        events = await call.results()
        failed = batch_error(events, single)
        if failed is not None:
            status, message = failed
            await self._send(identity, ErrorMsg(rid, message, status))
        elif single:
            await self._send(
                identity, FinalMsg(rid, **present_result(events[0].result, options, self.model))
            )
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
            await asyncio.wait_for(
                self.socket.send_multipart([identity, protocol.encode(msg)]), SEND_TIMEOUT_S
            )
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


def _ignore_outcome(future: asyncio.Future) -> None:
    """A reply sent without waiting: whether it went (zmq.Again, EHOSTUNREACH) does not matter."""
    if not future.cancelled():
        future.exception()


def _client_types() -> str:
    return ", ".join(protocol.CLIENT_TYPES)
