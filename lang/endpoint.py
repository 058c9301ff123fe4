"""RuntimeEndpoint: the ZeroMQ client of a running `spruce serve`.

    backend = sl.RuntimeEndpoint("tcp://127.0.0.1:30001")   # the server's --zmq-port
    backend = sl.RuntimeEndpoint(address, api_key="...")    # a server run with --api-key
    backend = sl.RuntimeEndpoint("http://127.0.0.1:30000")  # HTTP instead: lang/http_endpoint.py

One DEALER socket per endpoint, owned by an I/O thread (a ZeroMQ socket must not be used
by two threads at once). Callers, from any thread, hand their frames to the I/O thread
over an inproc PUSH socket (under a lock) and wait on a queue of their own: the I/O thread
demultiplexes the replies by request id. The protocol is spruce.runtime.protocol.dsl:
each message goes as an envelope (rid, API key, body); replies are one orjson frame.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from spruce.lang.backend import Backend, new_rid
from spruce.lang.errors import ProgramError, RuntimeRequestError, RuntimeUnavailableError
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.protocol.dsl import (
    AbortMsg,
    ChunkMsg,
    ErrorMsg,
    FinalMsg,
    FlushCacheMsg,
    GenerateMsg,
    InfoMsg,
    ModelInfoMsg,
    decode,
    envelope,
)  # fmt: skip

logger = logging.getLogger("spruce.lang")

DEFAULT_ADDRESS = "tcp://127.0.0.1:30001"
CONNECT_TIMEOUT_S = 3.0  # the model_info ping when an endpoint is created
PING_TIMEOUT_S = 10.0  # a liveness ping after HEARTBEAT_S of silence on a request
HEARTBEAT_S = 30.0
_CLOSED = object()  # put on every waiting queue when the connection closes


class RuntimeEndpoint(Backend):
    """A running Spruce runtime, reached over ZeroMQ. Creating one pings the runtime
    (model_info) and fails within `connect_timeout` seconds if nothing answers.

    request_timeout: the most seconds to wait for a request's next message (None: no
    limit; a runtime that stops answering is still detected by a liveness ping).
    liveness_check: called about once a second while waiting; raises to give up (a
    launcher uses it to notice that its runtime process died).
    api_key: the server's --api-key, sent with every message (see protocol/dsl.py)."""

    def __new__(cls, address: str = DEFAULT_ADDRESS, **kwargs: Any):
        """An http:// or https:// address gives the HTTP transport (spruce.lang.http_endpoint)."""
        if (
            cls is RuntimeEndpoint
            and isinstance(address, str)
            and address.startswith(("http://", "https://"))
        ):
            from spruce.lang.http_endpoint import HttpEndpoint

            return HttpEndpoint(address, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        request_timeout: float | None = None,
        liveness_check: Callable[[], None] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.address = normalize_address(address)
        self.request_timeout = request_timeout
        self._liveness_check = liveness_check
        self._conn = ZmqConnection(self.address, api_key)
        try:
            self._info = self._call(ModelInfoMsg(new_rid()), connect_timeout, "answered").info
        except BaseException:
            self._conn.close()
            raise

    def model_info(self) -> dict[str, Any]:
        return dict(self._info)

    def generate(self, msg: GenerateMsg) -> FinalMsg:
        if msg.stream:
            raise ValueError("generate() takes non-streaming requests; use generate_stream()")
        replies = self._conn.open(msg.rid)
        try:
            self._conn.send(msg)
            reply = self._wait(msg.rid, replies, self.request_timeout)
            while isinstance(reply, ChunkMsg):  # not expected without stream; skip
                reply = self._wait(msg.rid, replies, self.request_timeout)
            return reply
        except BaseException:
            self._abort(msg.rid)
            raise
        finally:
            self._conn.forget(msg.rid)

    def generate_stream(self, msg: GenerateMsg) -> Iterator[ChunkMsg | FinalMsg]:
        msg.stream = True
        replies = self._conn.open(msg.rid)
        finished = False
        try:
            self._conn.send(msg)
            while not finished:
                reply = self._wait(msg.rid, replies, self.request_timeout)
                finished = isinstance(reply, FinalMsg)
                yield reply
        finally:
            if not finished:  # the consumer stopped early, or an error: free the runtime's slots
                self._abort(msg.rid)
            self._conn.forget(msg.rid)

    def flush_cache(self) -> None:
        self._call(FlushCacheMsg(new_rid()), self.request_timeout, "flushed its cache")

    def ping(self, timeout: float = PING_TIMEOUT_S) -> dict[str, Any]:
        return self._call(ModelInfoMsg(new_rid()), timeout, "answered").info

    def close(self) -> None:
        self._conn.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.address!r})"

    # -- internals --------------------------------------------------------------------------

    def _call(self, msg: Any, timeout: float | None, what: str) -> InfoMsg:
        """One request, one reply (model_info / flush_cache)."""
        replies = self._conn.open(msg.rid)
        try:
            self._conn.send(msg)
            return self._wait(msg.rid, replies, timeout, what=what, heartbeat=timeout is None)
        finally:
            self._conn.forget(msg.rid)

    def _wait(self, rid: str, replies: queue.Queue, timeout: float | None, what: str = "answered",
              heartbeat: bool = True):  # fmt: skip
        """The request's next message; ErrorMsg becomes RuntimeRequestError."""
        start = last = time.monotonic()
        while True:
            try:
                reply = replies.get(timeout=1.0)
                break
            except queue.Empty:
                pass
            now = time.monotonic()
            if self._liveness_check is not None:
                self._liveness_check()
            if timeout is not None and now - start >= timeout:
                raise RuntimeUnavailableError(
                    self.address, _silence_message(self.address, what, timeout)
                )
            if heartbeat and now - last >= HEARTBEAT_S:
                self.ping()  # raises RuntimeUnavailableError if the runtime is gone
                last = time.monotonic()
        if reply is _CLOSED:
            raise RuntimeUnavailableError(
                self.address, f"the connection to {self.address} was closed"
            )
        if isinstance(reply, ErrorMsg):
            raise RuntimeRequestError(reply.message, reply.status, self.address)
        return reply

    def _abort(self, rid: str) -> None:
        try:
            self._conn.send(AbortMsg(rid))
        except RuntimeUnavailableError:
            pass


def normalize_address(address: str) -> str:
    if not isinstance(address, str) or not address:
        raise ProgramError(
            f"a runtime address is a string like {DEFAULT_ADDRESS!r}; got {address!r}"
        )
    if "://" not in address:
        address = "tcp://" + address
    return address


def _silence_message(address: str, what: str, timeout: float) -> str:
    return (
        f"no Spruce runtime {what} at {address} within {timeout:g} s; start one with "
        f"`spruce serve --zmq-port <port>` (or `python -m spruce.runtime serve`), or launch "
        f"one from Python with sl.Runtime()"
    )


class ZmqConnection:
    """A DEALER socket shared by every thread: sends go through the I/O thread, replies
    come back on per-rid queues."""

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self.address = address
        self._api_key = api_key
        self._ctx = zmq.Context()
        self._pending: dict[str, queue.Queue] = {}
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._closed = False
        handoff = f"inproc://spruce-lang-{uuid.uuid4().hex}"
        self._inbox = self._ctx.socket(zmq.PULL)  # used by the I/O thread only
        self._inbox.bind(handoff)
        self._outbox = self._ctx.socket(zmq.PUSH)  # used by callers, under _send_lock
        self._outbox.connect(handoff)
        self._dealer = self._ctx.socket(zmq.DEALER)  # used by the I/O thread only
        self._dealer.setsockopt(zmq.LINGER, 0)
        try:
            self._dealer.connect(address)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise RuntimeUnavailableError(address, f"cannot connect to {address}: {e}") from None
        self._thread = threading.Thread(target=self._loop, name="spruce-zmq", daemon=True)
        self._thread.start()

    def open(self, rid: str) -> queue.Queue:
        replies: queue.Queue = queue.Queue()
        with self._pending_lock:
            self._pending[rid] = replies
        return replies

    def forget(self, rid: str) -> None:
        with self._pending_lock:
            self._pending.pop(rid, None)

    def send(self, msg: Any) -> None:
        with self._send_lock:
            if self._closed:
                raise RuntimeUnavailableError(
                    self.address, f"the connection to {self.address} is closed"
                )
            self._outbox.send_multipart(envelope(msg, self._api_key))

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.send(b"")  # one frame: tells the I/O thread to stop
        self._thread.join(timeout=5)
        with self._pending_lock:
            for replies in self._pending.values():
                replies.put(_CLOSED)
        self._outbox.close(linger=0)
        self._ctx.term()

    # -- the I/O thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._inbox in events and not self._forward():
                break
            if self._dealer in events:
                self._receive()
        self._inbox.close(linger=0)
        self._dealer.close(linger=0)

    def _forward(self) -> bool:
        frames = self._inbox.recv_multipart()
        if len(frames) == 1:
            return False
        try:
            self._dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the runtime is not taking messages (gone, or its queue is full)
            rid = frames[0].decode()
            message = f"cannot send to {self.address}: the runtime does not take messages"
            self._deliver(rid, ErrorMsg(rid, message, status=503))
        return True

    def _receive(self) -> None:
        while True:
            try:
                frame = self._dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except InvalidRequestError as e:
                logger.warning("dropped a malformed message from %s: %s", self.address, e)
                continue
            if (
                isinstance(msg, ErrorMsg) and msg.rid == ""
            ):  # about the connection (the key): every call
                self._deliver_all(msg)
            else:
                self._deliver(msg.rid, msg)

    def _deliver_all(self, msg: ErrorMsg) -> None:
        with self._pending_lock:
            waiting = list(self._pending.items())
        for rid, replies in waiting:
            replies.put(ErrorMsg(rid, msg.message, msg.status))

    def _deliver(self, rid: str, msg: Any) -> None:
        with self._pending_lock:
            replies = self._pending.get(rid)
        if replies is not None:  # else: a request already given up (aborted, timed out)
            replies.put(msg)

    def _close_sockets(self) -> None:
        for sock in (self._inbox, self._outbox, self._dealer):
            sock.close(linger=0)
        self._ctx.term()
