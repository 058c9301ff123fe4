"""The front door without a server: the request manager's admission, deadlines and stream
backlog (a fake scheduler socket), the supervisor, the ZeroMQ decoder on malformed frames,
the serve flags of the limits, the ZeroMQ bind rule and the JSON content-type rule."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.request import FinishReason
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.update import Finished, ReqUpdate
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.limits import ServingLimits
from spruce.runtime.protocol import dsl
from spruce.runtime.protocol.ipc import AbortRequests, NewRequests, StepOutput, decode
from spruce.runtime.server.request_manager import Refused, RequestManager
from spruce.runtime.server.supervisor import Supervisor


class FakeScheduler:
    """Stands in for the PUSH socket to the scheduler: records every message sent."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(decode(data))

    def aborts(self) -> list[AbortRequests]:
        return [m for m in self.sent if isinstance(m, AbortRequests)]


def manager_with(tokenizer, max_running: int = 2, **limits) -> tuple[RequestManager, FakeScheduler]:
    scheduler = FakeScheduler()
    manager = RequestManager(
        scheduler, None, tokenizer, limits=ServingLimits(**limits), max_running=max_running
    )
    return manager, scheduler


def request(stream: bool = False, timeout_s: float | None = None) -> ValidRequest:
    return ValidRequest(
        [1, 2, 3], SamplingParams(), RequestOptions(stream=stream, timeout_s=timeout_s), None
    )


def finish(rid: str, kind: str = "length", message: str | None = None) -> StepOutput:
    done = Finished(FinishReason(kind, None, message), 0, 0.5, 0.1, 0.4)
    return StepOutput([ReqUpdate(rid, 0, [7], 0, finished=done)], 0, 0)


# -- admission ------------------------------------------------------------------------------------


def test_full_server_refuses_with_503_and_retry_after(tiny_tokenizer):
    manager, scheduler = manager_with(tiny_tokenizer, max_running=2, max_waiting_requests=1)
    manager.submit([request(), request()], ["a", "b"], client="x")
    with pytest.raises(Refused) as refused:
        manager.submit([request(), request()], ["c", "d"], client="y")  # 4 > 2 running + 1 waiting
    assert refused.value.status == 503 and refused.value.retry_after_s == 1
    assert "--max-waiting-requests" in refused.value.message
    assert (
        manager.in_flight == 2
        and len([m for m in scheduler.sent if isinstance(m, NewRequests)]) == 1
    )
    manager.submit([request()], ["c"], client="y")  # one more fits


def test_per_client_cap_counts_every_request_and_is_released(tiny_tokenizer):
    manager, _ = manager_with(tiny_tokenizer, max_running=100, max_requests_per_client=3)
    manager.submit([request(), request()], ["a", "b"], client="x")
    with pytest.raises(Refused) as refused:
        manager.submit([request(), request()], ["c", "d"], client="x")  # prompts x n count each
    assert refused.value.status == 429 and "--max-requests-per-client" in refused.value.message
    manager.submit(
        [request(), request(), request()], ["e", "f", "g"], client="other"
    )  # another client
    manager._on_step(finish("a"))
    assert manager.per_client == {"x": 1, "other": 3}
    manager.submit([request(), request()], ["c", "d"], client="x")


def test_a_rid_in_flight_is_refused_not_asserted(tiny_tokenizer):
    manager, _ = manager_with(tiny_tokenizer, max_running=10)
    manager.submit([request()], ["z1:same"], client="z1")
    for rids in (["z1:same"], ["n", "n"]):
        with pytest.raises(Refused) as refused:
            manager.submit([request() for _ in rids], rids, client="z2")
        assert (
            refused.value.status == 400 and "already in flight or repeated" in refused.value.message
        )
    assert manager.in_flight == 1 and manager.per_client == {"z1": 1}


# -- deadline and stream backlog ------------------------------------------------------------------


def test_deadline_aborts_the_request_and_says_why(tiny_tokenizer):
    async def main():
        manager, scheduler = manager_with(tiny_tokenizer, max_running=10)
        call = manager.submit([request(timeout_s=0.05)], ["late"], client="x")
        await asyncio.sleep(0.2)
        [abort] = scheduler.aborts()
        assert abort.rids == ["late"] and "deadline" in abort.message and "0.05" in abort.message
        manager._on_step(finish("late", "abort", abort.message))
        [event] = await call.results()
        assert event.finished and event.result["meta_info"]["finish_reason"]["type"] == "abort"
        assert manager.in_flight == 0 and manager.per_client == {}

    asyncio.run(main())


def test_server_default_deadline_and_close_cancels_it(tiny_tokenizer):
    async def main():
        manager, scheduler = manager_with(tiny_tokenizer, max_running=10, request_timeout_s=0.05)
        call = manager.submit([request()], ["quick"], client="x")
        manager._on_step(finish("quick"))
        call.close()
        await asyncio.sleep(0.15)
        assert scheduler.aborts() == []  # finished in time: no abort

    asyncio.run(main())


def test_a_stream_nobody_reads_is_aborted_at_the_backlog(tiny_tokenizer):
    manager, scheduler = manager_with(tiny_tokenizer, max_running=10, max_stream_backlog=5)
    call = manager.submit([request(stream=True)], ["slow"], client="x")
    for _ in range(5):
        manager._on_step(StepOutput([ReqUpdate("slow", 0, [9], 0)], 1, 0))
    assert scheduler.aborts() == []
    manager._on_step(StepOutput([ReqUpdate("slow", 0, [9], 0)], 1, 0))  # the 6th unread event
    [abort] = scheduler.aborts()
    assert abort.rids == ["slow"] and "--max-stream-backlog" in abort.message
    for _ in range(3):  # steps already on their way add no second abort
        manager._on_step(StepOutput([ReqUpdate("slow", 0, [9], 0)], 1, 0))
    manager._on_step(finish("slow", "abort", abort.message))
    events = [call.queue.get_nowait() for _ in range(call.queue.qsize())]
    assert events[-1].error == abort.message and events[-1].status == 503
    assert len(scheduler.aborts()) == 1 and manager.in_flight == 0


# -- supervisor -----------------------------------------------------------------------------------


def test_supervisor_restarts_a_failed_task_then_gives_up():
    async def main():
        runs, gave_up = [], []

        async def flaky():
            runs.append(1)
            if len(runs) < 3:
                raise RuntimeError("boom")
            await asyncio.sleep(10)

        supervisor = Supervisor(gave_up.append, max_restarts=5)
        supervisor.start("flaky", flaky)
        await asyncio.sleep(0.1)
        assert (
            "flaky" in supervisor.problem() and "boom" not in supervisor.problem()
        )  # /health shows no repr
        await asyncio.sleep(0.6)
        assert len(runs) == 3 and supervisor.problem() is None and gave_up == []

        async def broken():
            raise ValueError("always")

        supervisor.start("broken", broken)
        await asyncio.sleep(2.0)
        assert len(gave_up) == 1 and "broken" in gave_up[0] and "broken" in supervisor.problem()
        assert "always" not in supervisor.problem()
        for task in supervisor.tasks.values():
            task.cancel()

    asyncio.run(main())


# -- ZeroMQ frames ---------------------------------------------------------------------------------


MALFORMED = [
    b'{"type": [], "rid": "x"}', b'{"type": {}, "rid": "x"}', b'{"type": null}', b"[]", b"null", b"7",
    b'"generate"', b"\xff\xfe", b"", b'{"type": "generate"}', b'{"type": "generate", "rid": 5}',
    b'{"type": "generate", "rid": "r", "api_key": 5}', b'{"type": "generate", "rid": "r", "frob": 1}',
    b'{"type": "abort", "rid": "r", "text": "x"}', b'{"type": "generate", "rid": "r"' + b"]" * 5000,
    b"[" * 100_000,
]  # fmt: skip


@pytest.mark.parametrize("frame", MALFORMED)
def test_malformed_frames_raise_only_invalid_request_error(frame):
    with pytest.raises(InvalidRequestError):
        dsl.decode(frame)


def test_random_bytes_never_crash_the_decoder():
    rng = random.Random(0)
    pieces = [
        b"{",
        b"}",
        b"[",
        b"]",
        b'"type"',
        b'"rid"',
        b":",
        b",",
        b'"generate"',
        b"1e999",
        b"null",
        b'"x"',
    ]
    for _ in range(2000):
        frame = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        try:
            dsl.decode(frame)
        except InvalidRequestError:
            pass


def test_api_key_travels_in_each_envelope():
    rid, key, body = dsl.envelope(dsl.ModelInfoMsg("r"), api_key="secret")
    assert (rid, key) == (b"r", b"secret") and "api_key" not in orjson.loads(body)
    assert (
        dsl.decode(body) == dsl.ModelInfoMsg("r") and dsl.envelope(dsl.ModelInfoMsg("r"))[1] == b""
    )
    assert dsl.envelope_rid(b"r") == "r" and dsl.envelope_rid(b"\xff") is None
    assert dsl.envelope_rid(b"x" * (dsl.MAX_RID_BYTES + 1)) is None
    assert dsl.rid_of(b'{"type": [], "rid": "x"}') == "x" and dsl.rid_of(b"{bad") is None
    with pytest.raises(InvalidRequestError, match="envelope"):  # an old client's key in the body
        dsl.decode(b'{"type": "model_info", "rid": "r", "api_key": "secret"}')


# -- flags, bind rule, content type ---------------------------------------------------------------


def test_limit_flags_reach_the_server_options():
    from spruce.runtime.cli import build_parser, server_options

    args = build_parser().parse_args([
        "serve", "--max-top-logprobs", "5", "--max-requests-per-client", "7", "--request-timeout-s", "2.5",
        "--allow-unauthenticated-zmq", "--allowed-origins", "https://a.example, https://b.example",
    ])  # fmt: skip
    options = server_options(args)
    assert options.request_limits.max_top_logprobs == 5 and options.request_limits.max_n == 128
    assert (
        options.serving_limits.max_requests_per_client == 7
        and options.serving_limits.request_timeout_s == 2.5
    )
    assert options.allow_unauthenticated_zmq is True
    assert options.origins == ["https://a.example", "https://b.example"]
    assert server_options(build_parser().parse_args(["serve"])).allow_unauthenticated_zmq is False


@pytest.mark.parametrize(
    "host,extra,refused",
    [("0.0.0.0", {}, True), ("192.168.1.5", {}, True), ("0.0.0.0", {"api_key": "k"}, False),
     ("0.0.0.0", {"allow_unauthenticated_zmq": True}, False), ("127.0.0.1", {}, False)],
)  # fmt: skip
def test_zmq_port_needs_a_key_beyond_loopback(host, extra, refused):
    import zmq.asyncio
    from test_server import free_port

    from spruce.runtime.config import ServerOptions
    from spruce.runtime.server.launch import StartupError, _bind_zmq

    context = zmq.asyncio.Context()
    options = ServerOptions(host=host, zmq_port=free_port(), **extra)
    try:
        if refused:
            with pytest.raises(StartupError, match="--allow-unauthenticated-zmq"):
                _bind_zmq(context, options)
        elif host in ("127.0.0.1", "0.0.0.0"):
            _bind_zmq(context, options).close()
    finally:
        context.term()


@pytest.mark.parametrize(
    "content_type,body,ok",
    [(b"application/json", b"{}", True), (b"Application/JSON; charset=utf-8", b"{}", True), (None, b"", True),
     (None, b"{}", False), (b"text/plain", b"{}", False), (b"application/x-www-form-urlencoded", b"a=1", False),
     (b"multipart/form-data; boundary=x", b"", False)],
)  # fmt: skip
def test_post_bodies_must_be_declared_json(content_type, body, ok):
    from spruce.runtime.server.http.middleware import _declared_json

    assert _declared_json(content_type, body) is ok


# -- constrained requests are prepared off the event loop -----------------------------------------


def test_a_slow_constraint_conversion_does_not_stop_the_event_loop(tiny_tokenizer):
    import threading
    import time

    from spruce.runtime.core.validation import Draft, ModelLimits
    from spruce.runtime.server.native import NATIVE_NAMES, ModelContext

    class SlowModel(ModelContext):
        def check(self, draft, names):
            self.threads.append(threading.current_thread())
            if draft.has_constraint():
                time.sleep(0.3)  # stands in for a long schema conversion
            return super().check(draft, names)

    model = SlowModel(tiny_tokenizer, "m", "/m", ModelLimits(384, 1024))
    object.__setattr__(model, "threads", [])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        sampling = SamplingParams(max_new_tokens=4, regex="[ab]{3}")
        call = await model.validate(Draft("hi", sampling=sampling), NATIVE_NAMES)
        task.cancel()
        [valid] = call.requests
        assert valid.constraint is not None and ticks >= 10  # the loop ran while it converted
        plain = Draft("hi", sampling={"max_new_tokens": 4})
        await model.validate(plain, NATIVE_NAMES)
        with pytest.raises(
            InvalidRequestError, match="context"
        ):  # long text: tokenized off the loop too
            await model.validate(Draft("word " * 8000, sampling=plain.sampling), NATIVE_NAMES)

    asyncio.run(main())
    main_thread = threading.main_thread()
    assert [t is main_thread for t in model.threads] == [False, True, False]


def test_http_connections_send_at_once():
    """The listening socket has TCP_NODELAY and its connections inherit it: without it a
    keep-alive response's body waited for the client's delayed ACK (~40 ms a request)."""
    import socket

    from spruce.runtime.server.launch import _bind_http

    listener = _bind_http("127.0.0.1", 0)
    try:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        conn.close()
        client.close()
    finally:
        listener.close()
