"""Fairness and liveness at the front end (issue 51), without a model: the per-client
prompt-token budget (429 + Retry-After), the client sent with each request, and /health read
from the scheduler's heartbeat age, never from a round trip that waits behind a long step
(the step is gated by an event; the clock is injected: no wall-clock bound anywhere)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest
import zmq
import zmq.asyncio

from spruce.runtime.config import ServerOptions
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.request import FinishReason
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.core.update import Finished, ReqUpdate
from spruce.runtime.core.validation import ModelLimits, ValidRequest
from spruce.runtime.limits import ServingLimits
from spruce.runtime.protocol.ipc import (
    ControlRequest,
    Heartbeat,
    NewRequests,
    Ready,
    StepOutput,
    decode,
    encode,
)
from spruce.runtime.server.request_manager import Refused, RequestManager


class FakeScheduler:
    """Stands in for the PUSH socket to the scheduler: records every message sent."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(decode(data))


def prompt(tokens: int) -> ValidRequest:
    return ValidRequest(list(range(1, tokens + 1)), SamplingParams(), RequestOptions(), None)


def finish(rid: str) -> StepOutput:
    done = Finished(FinishReason("length"), 0, 0.5, 0.1, 0.4)
    return StepOutput([ReqUpdate(rid, 0, [7], 0, finished=done)], 0, 0)


def manager_with(tokenizer, receiver=None, **limits) -> tuple[RequestManager, FakeScheduler]:
    scheduler = FakeScheduler()
    manager = RequestManager(
        scheduler, receiver, tokenizer, limits=ServingLimits(**limits), max_running=100
    )
    return manager, scheduler


# -- the per-client prompt-token budget ----------------------------------------------------------


def test_the_token_budget_refuses_with_429_and_is_released(tiny_tokenizer):
    manager, _ = manager_with(tiny_tokenizer, max_tokens_per_client=10)
    manager.submit([prompt(6)], ["a"], client="x")
    with pytest.raises(Refused) as refused:
        manager.submit([prompt(3), prompt(3)], ["b", "c"], client="x")  # 6 + 6 > 10
    assert refused.value.status == 429 and refused.value.retry_after_s == 1
    assert "--max-tokens-per-client" in refused.value.message
    manager.submit([prompt(4)], ["d"], client="x")  # 6 + 4 fits
    manager.submit([prompt(10)], ["e"], client="y")  # another client's own budget
    assert manager.client_tokens == {"x": 10, "y": 10}
    manager._on_step(finish("a"))
    assert manager.client_tokens == {"x": 4, "y": 10}
    manager.submit([prompt(6)], ["f"], client="x")
    for rid in ("d", "e", "f"):
        manager._on_step(finish(rid))
    assert manager.client_tokens == {} and manager.states == {}


def test_a_call_past_the_budget_runs_when_its_client_has_nothing_else_in_flight(tiny_tokenizer):
    manager, scheduler = manager_with(tiny_tokenizer, max_tokens_per_client=10)
    manager.submit([prompt(8) for _ in range(8)], [f"big{i}" for i in range(8)], client="x")
    with pytest.raises(Refused):
        manager.submit([prompt(1)], ["small"], client="x")  # until the large call ends
    [sent] = [m for m in scheduler.sent if isinstance(m, NewRequests)]
    assert {new.client for new in sent.requests} == {"x"}  # the scheduler shares prefill by it


def app_with(manager, tokenizer):
    from spruce.runtime.server.app import build_app
    from spruce.runtime.server.metrics import Metrics
    from spruce.runtime.server.native import ModelContext

    launcher = SimpleNamespace(
        options=ServerOptions(), manager=manager, draining=False, schedulers=[],
        supervisor=SimpleNamespace(problem=lambda: None),
    )  # fmt: skip
    model = ModelContext(tokenizer, "m", "/m", ModelLimits(tokenizer.vocab_size, 1024))
    ready = Ready("m", "/m", 1024, tokenizer.vocab_size, 4096, {})
    return build_app(launcher, model, Metrics(), ready)


def test_over_the_token_budget_http_answers_429_with_retry_after(tiny_tokenizer):
    manager, _ = manager_with(tiny_tokenizer, max_tokens_per_client=10)

    async def main():
        app = app_with(manager, tiny_tokenizer)
        transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 1234))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            body = {"input_ids": list(range(1, 9)), "sampling_params": {"max_new_tokens": 1}}
            first = asyncio.ensure_future(client.post("/generate", json=body))
            while not manager.states:
                await asyncio.sleep(0.01)
            second = await client.post("/generate", json=body)
            assert second.status_code == 429 and second.headers["Retry-After"] == "1"
            assert "--max-tokens-per-client" in second.json()["error"]["message"]
            manager._on_step(finish(next(iter(manager.states))))
            assert (await first).status_code == 200

    asyncio.run(main())


# -- /health: the heartbeat's age, not a round trip ----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_health_answers_from_the_heartbeat_age_while_a_step_is_blocked(tiny_tokenizer):
    """The fake scheduler beats, then blocks in a step (an event it waits on) and answers
    nothing: /health is 200 while the beat is younger than --scheduler-timeout-s, 503 past
    it (the clock moved on), and 200 again once the loop beats after the step."""
    context = zmq.asyncio.Context()
    receiver = context.socket(zmq.PULL)
    receiver.bind("inproc://fairness-health")
    scheduler_out = zmq.Context.shadow(context.underlying).socket(zmq.PUSH)  # a thread's
    scheduler_out.connect("inproc://fairness-health")
    in_step, step_done = threading.Event(), threading.Event()
    manager, inbox = manager_with(tiny_tokenizer, receiver, scheduler_timeout_s=120)
    clock = manager.clock = Clock()

    def scheduler_loop():
        scheduler_out.send(encode(Heartbeat()))
        in_step.set()
        step_done.wait(60)  # the long step: no heartbeat, no answer to anything
        scheduler_out.send(encode(Heartbeat()))

    async def beat_arrives(client):
        while (await client.get("/health")).json()["heartbeat_age_s"] != 0:
            await asyncio.sleep(0.01)

    async def main():
        app = app_with(manager, tiny_tokenizer)
        receiving = asyncio.ensure_future(manager.receive_forever())
        loop = threading.Thread(target=scheduler_loop)
        loop.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            await beat_arrives(client)
            in_step.wait(60)
            clock.now += 100  # 100 s into the step
            health = await client.get("/health")
            assert health.status_code == 200, health.text
            assert health.json()["heartbeat_age_s"] == 100 and health.json()["ready"] is True
            assert not [m for m in inbox.sent if isinstance(m, ControlRequest)]  # no ping
            clock.now += 30  # past --scheduler-timeout-s
            stale = await client.get("/health")
            assert stale.status_code == 503 and stale.json()["heartbeat_age_s"] == 130
            assert "--scheduler-timeout-s" in stale.json()["error"]["message"]
            step_done.set()
            await beat_arrives(client)
            assert (await client.get("/health")).status_code == 200
        receiving.cancel()
        loop.join()

    try:
        asyncio.run(main())
    finally:
        step_done.set()
        scheduler_out.close(linger=0)
        receiver.close(linger=0)
        context.term()


def test_ready_is_503_while_the_queue_is_full_and_health_stays_200(tiny_tokenizer):
    manager, _ = manager_with(tiny_tokenizer, max_waiting_requests=0)
    manager.capacity = 2

    async def main():
        app = app_with(manager, tiny_tokenizer)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            assert (await client.get("/ready")).status_code == 200
            manager.submit([prompt(2), prompt(2)], ["a", "b"], client="x")
            ready = await client.get("/ready")
            assert ready.status_code == 503 and "full" in ready.json()["error"]["message"]
            assert ready.json()["in_flight_requests"] == 2
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["ready"] is False

    asyncio.run(main())
