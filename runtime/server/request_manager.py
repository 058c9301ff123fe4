"""The front end's side of the scheduler: submits tokenized requests, receives step outputs,
detokenizes them and hands each caller its events. Also the control round trips (ping,
stats, flush_cache, shutdown).

The detokenizer runs inline, on the front end's event loop (`RequestState.apply`), not in a
process or thread of its own: it costs ~3.4 us per token (SmolLM2's tokenizer; a few % of
the front end's CPU per streamed token), while one more process hop costs ~85 us of CPU per
step for encoding and decoding the step output (16 requests) plus a third busy process on
the machine, and a thread would pay more in GIL and loop hand-offs than the work itself.

    call = manager.submit([valid_request, ...])     # core.validation.ValidRequest
    try:
        async for event in call:       # Event: chunks, then one finished event per request
            ...
    finally:
        call.close()                   # aborts whatever has not finished (client gone)

Bounded queues (`limits.ServingLimits`): `submit` refuses a call that would put more than
--max-running-requests + --max-waiting-requests requests in flight (503, retry later) or
give one client more than --max-requests-per-client (429), counting every request of the
call (prompts x n), or more than --max-tokens-per-client prompt tokens in flight (429; a
client with nothing in flight may send one call of any size the other limits allow, so a
legitimate large batch is never refused forever), and a request id already in flight
(400); nothing is registered then.
A streamed call whose reader leaves more than --max-stream-backlog events per request
unread is aborted with an error (memory stays bounded however slowly a client reads). A
request past its deadline (options.timeout_s, or --request-timeout-s) is aborted: its
final event has finish_reason abort and says why.

Every request ends: an update that cannot be applied here (or built in the scheduler) fails
its request alone with a message naming no internals, and its slot, client count and
tracking entry are released (the entry last). The scheduler's loop sends a heartbeat every
0.5 s; one silent past --scheduler-timeout-s (a stuck step) is stalled: its requests and
round trips fail (503), new requests are refused (503) and /health fails, until it is
heard from again. `liveness()` (/health) reads the age of the latest heartbeat, with no
round trip that would wait behind a long step; `readiness()` (/ready) says whether a new
request would be taken now.

With `--dp N` (replicas.py) each request goes to the replica the router picks; aborts go
where the request runs; control commands go to every live replica (stats are summed, with
each replica's own under "replicas"). A dead replica fails only its own requests (503);
the manager is dead once no replica is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.limits import ServingLimits
from spruce.runtime.protocol.ipc import (
    UPDATE_FAILED,
    AbortRequests,
    ControlReply,
    ControlRequest,
    NewRequest,
    NewRequests,
    RequestFailed,
    ReqUpdate,
    StepOutput,
    decode,
)
from spruce.runtime.server.replicas import Replicas, SchedulerUnavailable, merge_stats
from spruce.runtime.server.request_state import Event, RequestState
from spruce.runtime.text.tokenizer import Tokenizer

logger = logging.getLogger("spruce.server")
WATCH_PERIOD_S = 0.5  # how often the receiver looks for a stalled scheduler when nothing arrives


class Refused(Exception):
    """A call `submit` did not take: full queue (503), too many in flight for its client
    (429), a request id already in flight (400). `retry_after_s` is set for 503 / 429."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


class Call:
    """The requests of one API call (a batch, or `n` choices): an async iterator of events."""

    def __init__(self, manager: RequestManager, tokenizer: Tokenizer, size: int) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.states: list[RequestState] = []
        self.pending = size
        self.started = time.perf_counter()
        self.deadline: asyncio.TimerHandle | None = None  # aborts the call at its timeout_s

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while self.pending:
            event = await self.queue.get()
            if event.finished or event.error is not None:
                self.pending -= 1
            yield event

    async def results(self) -> list[Event]:
        """The finished (or failed) event of every request, in order."""
        out: list[Event | None] = [None] * len(self.states)
        async for event in self:
            if event.finished or event.error is not None:
                out[event.index] = event
        return out

    def close(self, message: str = "the client disconnected") -> None:
        """Aborts the requests that have not finished; idempotent."""
        if self.deadline is not None:
            self.deadline.cancel()
        rids = [s.rid for s in self.states if not s.done]
        if rids:
            self.manager.abort(rids, message)


class RequestManager:
    def __init__(
        self, sender: zmq.Socket | list[zmq.Socket], receiver: zmq.asyncio.Socket, tokenizer: Tokenizer,
        observer=None, limits: ServingLimits | None = None, max_running: int = 128, router=None,
    ) -> None:  # fmt: skip
        """`sender`: the scheduler's inbox, or one per replica (`router` then picks)."""
        self.limits = limits or ServingLimits()
        self.capacity = max_running + self.limits.max_waiting_requests  # requests in flight at most
        self.per_client: dict[str, int] = {}  # requests in flight by client (address / identity)
        self.client_tokens: dict[str, int] = {}  # their prompt tokens
        self.clock = time.monotonic  # heartbeat ages (tests set a fake clock)
        self.replicas = Replicas(sender if isinstance(sender, list) else [sender], router)
        self.receiver = receiver  # PULL
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.replies: dict[int, tuple[int, asyncio.Future]] = {}  # control id -> (replica, reply)
        self.control_ids = itertools.count()
        self.observer = (
            observer  # metrics: on_finished(state, event, update), on_failed(state, ...)
        )
        self.dead: str | None = None  # why the scheduler (every replica) is unusable, once it is

    @property
    def in_flight(self) -> int:
        return len(self.states)

    # -- requests ---------------------------------------------------------------------------

    def submit(
        self,
        items: list[ValidRequest],
        rids: list[str] | None = None,
        client_rids: list[str] | None = None,
        client: str = "",
    ) -> Call:
        """Registers and sends the requests; their events arrive on the returned Call.
        Raises Refused (nothing registered) when the call does not fit (see the module doc)."""
        rids = rids or [uuid.uuid4().hex for _ in items]
        tokens = sum(len(v.input_ids) for v in items)
        self._admit(rids, client, tokens)
        call = Call(self, self.tokenizer, len(items))
        client_rids = client_rids or rids
        replicas = self.replicas.assign([v.input_ids for v in items])
        for i, (valid, rid) in enumerate(zip(items, rids)):
            state = RequestState(rid, client_rids[i], i, call, valid, client)
            state.replica = replicas[i]
            call.states.append(state)
            self.states[rid] = state
        self.per_client[client] = self.per_client.get(client, 0) + len(items)
        self.client_tokens[client] = self.client_tokens.get(client, 0) + tokens
        self._send_new(call.states, items)
        self._set_deadline(call, items)
        return call

    def _send_new(self, states: list[RequestState], items: list[ValidRequest]) -> None:
        """One NewRequests per replica; a replica that cannot take them fails them (503)."""
        groups: dict[int, list[tuple[RequestState, ValidRequest]]] = {}
        for state, valid in zip(states, items):
            groups.setdefault(state.replica, []).append((state, valid))
        for replica, group in groups.items():
            try:
                if self.dead:
                    raise SchedulerUnavailable(self.dead)
                news = [NewRequest(s.rid, v, s.client) for s, v in group]
                self.replicas.send(replica, NewRequests(news))
            except SchedulerUnavailable as e:
                for state, _ in group:
                    self._fail(state, str(e), 503)

    def _admit(self, rids: list[str], client: str, tokens: int) -> None:
        busy = [r for r in rids if r in self.states]
        if busy or len(set(rids)) != len(rids):
            raise Refused(
                400,
                f"request id(s) already in flight or repeated: {(busy or rids)[:5]}; use new ids",
            )
        retry = self.limits.retry_after_s
        live = self.replicas.live()
        if live and all(r.stalled for r in live):
            raise Refused(503, f"{live[0].stalled}; retry later", retry)
        if len(self.states) + len(rids) > self.capacity:
            message = (
                f"the server is full ({len(self.states)} requests in flight, at most {self.capacity}: "
                "--max-running-requests + --max-waiting-requests); retry later"
            )
            raise Refused(503, message, retry)
        mine, most = self.per_client.get(client, 0), self.limits.max_requests_per_client
        if mine + len(rids) > most:
            message = (
                f"this client has {mine} requests in flight and asked for {len(rids)} more; at most {most} "
                "(--max-requests-per-client; prompts x n count each)"
            )
            raise Refused(429, message, retry)
        self._check_tokens(client, tokens)

    def _check_tokens(self, client: str, tokens: int) -> None:
        """--max-tokens-per-client: prompt tokens in flight; a client with nothing in flight
        may send one call past it (it then waits for that call to end)."""
        mine, most = self.client_tokens.get(client, 0), self.limits.max_tokens_per_client
        if mine and mine + tokens > most:
            message = (
                f"this client has {mine} prompt tokens in flight and asked for {tokens} more; at "
                f"most {most} (--max-tokens-per-client); retry when its requests have finished"
            )
            raise Refused(429, message, self.limits.retry_after_s)

    def _set_deadline(self, call: Call, items: list[ValidRequest]) -> None:
        timeouts = [v.options.timeout_s for v in items if v.options.timeout_s is not None]
        timeout = min(timeouts) if timeouts else self.limits.request_timeout_s
        if timeout is not None and call.pending:
            call.deadline = asyncio.get_running_loop().call_later(
                timeout, self._expire, call, timeout
            )

    def _expire(self, call: Call, timeout: float) -> None:
        rids = [s.rid for s in call.states if not s.done]
        self.abort(rids, f"the request passed its deadline (timeout_s {timeout:g} s)")

    def abort(self, rids: list[str], message: str = "aborted by the client") -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in rids:
            state = self.states.get(rid)
            if state is not None:
                state.aborted = True
                by_replica.setdefault(state.replica, []).append(rid)
        for replica, live in by_replica.items():
            if not self.dead:
                with contextlib.suppress(SchedulerUnavailable):  # gone: the watchdog fails them
                    self.replicas.send(replica, AbortRequests(live, message), even_stalled=True)

    def abort_all(self, message: str) -> int:
        rids = list(self.states)
        self.abort(rids, message)
        return len(rids)

    def in_flight_matching(self, rid: str) -> list[str]:
        """The request `rid` or, for a batch submitted under that rid, its `rid-<i>` items."""
        prefix = rid + "-"
        return [
            r
            for r in self.states
            if r == rid or (r.startswith(prefix) and r[len(prefix) :].isdigit())
        ]

    # -- control round trips ---------------------------------------------------------------

    async def control(self, command: str, timeout: float) -> dict:
        """The command on every live replica. Raises SchedulerUnavailable on timeout or a dead
        scheduler, ValueError on refusal. With several replicas: merged (`merge_stats`)."""
        live = [r.index for r in self.replicas.live()]
        if self.dead or not live:
            raise SchedulerUnavailable(self.dead or "no scheduler replica is alive")
        answers = await asyncio.gather(*(self._control_one(r, command, timeout) for r in live))
        if len(self.replicas) == 1:
            return answers[0]
        return merge_stats(dict(zip(live, answers)))

    async def _control_one(self, replica: int, command: str, timeout: float) -> dict:
        msg_id = next(self.control_ids)
        future = asyncio.get_running_loop().create_future()
        self.replies[msg_id] = (replica, future)
        try:
            self.replicas.send(replica, ControlRequest(msg_id, command))
            reply: ControlReply = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            who = "the scheduler" if len(self.replicas) == 1 else f"scheduler replica {replica}"
            raise SchedulerUnavailable(
                f"{who} did not answer {command!r} within {timeout:g} s"
            ) from None
        finally:
            self.replies.pop(msg_id, None)
        if not reply.ok:
            raise ValueError(reply.error)
        if command == "flush_cache":
            self.replicas.flushed(replica)
        return reply.data

    # -- receiving --------------------------------------------------------------------------

    async def receive_forever(self) -> None:
        while True:
            if await self.receiver.poll(int(WATCH_PERIOD_S * 1000)):
                msg = decode(await self.receiver.recv())
                self._heard(msg.replica)
                self._on_message(msg)
            self._check_stalls()

    def _on_message(self, msg) -> None:
        if isinstance(msg, StepOutput):
            self._on_step(msg)
        elif isinstance(msg, RequestFailed):
            state = self.states.get(msg.rid)
            if state is not None:
                self._fail(state, msg.message, msg.status)
        elif isinstance(msg, ControlReply):
            _, future = self.replies.get(msg.id, (None, None))
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_step(self, msg: StepOutput) -> None:
        replica = self.replicas.all[msg.replica]
        replica.running, replica.waiting = msg.num_running, msg.num_waiting
        for update in msg.updates:
            state = self.states.get(update.rid)
            if state is None:
                continue
            try:
                event = state.apply(update)
            except Exception:  # this request's text or result: it alone fails
                logger.exception("the update of request %s could not be applied", update.rid)
                if update.finished is None:
                    self.abort([state.rid], "its output could not be sent")
                self._fail(state, UPDATE_FAILED, 500)
                continue
            self._deliver(state, event, update)

    def _deliver(self, state: RequestState, event: Event, update: ReqUpdate) -> None:
        if state.done:
            self._forget(state)
        state.call.queue.put_nowait(event)
        if state.done:
            self._observe(state, event, update)
        elif state.stream and state.error is None:
            self._check_backlog(state.call)

    def _observe(self, state: RequestState, event: Event, update: ReqUpdate) -> None:
        """Metrics of a finished request; a failure here is logged, never the request's."""
        if self.observer is None:
            return
        try:
            if event.error is not None:
                self.observer.on_failed(state, event.error, event.status)
            else:
                self.observer.on_finished(state, event, update)
        except Exception:
            logger.exception("the metrics of request %s failed", state.rid)

    # -- the scheduler watchdog -------------------------------------------------------------

    def _heard(self, index: int) -> None:
        replica = self.replicas.all[index]
        replica.heard_at = self.clock()
        if replica.stalled is not None:
            logger.warning("%s answers again", self._who(index))
            replica.stalled = None

    def _check_stalls(self) -> None:
        """A live scheduler silent past --scheduler-timeout-s (a step stuck; its loop sends
        a heartbeat every HEARTBEAT_S) is stalled: its requests and round trips fail (503),
        new requests are refused, /health fails; until it is heard from again."""
        timeout = self.limits.scheduler_timeout_s
        now = self.clock()
        for replica in self.replicas.live():
            if replica.stalled is None and now - replica.heard_at > timeout:
                self._stall(replica.index, f"{self._who(replica.index)} stopped answering (silent for more than "
                            f"{timeout:g} s, --scheduler-timeout-s)")  # fmt: skip

    def _stall(self, index: int, reason: str) -> None:
        logger.error("%s; failing its requests", reason)
        mine = [s.rid for s in self.states.values() if s.replica == index]
        self.abort(mine, reason)  # reaches it once it runs again: frees their slots
        self.replicas.all[index].stalled = reason
        self._fail_replica(index, reason)

    # -- liveness and readiness ----------------------------------------------------------------

    def liveness(self) -> tuple[str | None, dict]:
        """(why the server is not live, or None; its heartbeat ages). Live while some live
        scheduler replica was heard from within --scheduler-timeout-s, whatever its work:
        a long step delays heartbeats, a stuck one stops them."""
        live, limit = self.replicas.live(), self.limits.scheduler_timeout_s
        ages = [round(self.clock() - r.heard_at, 3) for r in live]
        body = {"heartbeat_age_s": min(ages, default=None), "scheduler_timeout_s": limit}
        if len(self.replicas) > 1:
            body["replica_heartbeat_age_s"] = {str(r.index): age for r, age in zip(live, ages)}
        if self.dead or not live:
            return self.dead or "no scheduler replica is alive", body
        if all(r.stalled or age > limit for r, age in zip(live, ages)):
            who = "the scheduler" if len(live) == 1 else "every live scheduler replica"
            heard = f"{who} stopped answering (its last heartbeat {min(ages):g} s ago; --scheduler-timeout-s {limit:g})"
            return live[0].stalled or heard, body
        return None, body

    def readiness(self) -> tuple[str | None, dict]:
        """(why a new request would be refused now, or None; the queue's numbers): the
        server is saturated when its queue is full (--max-running-requests +
        --max-waiting-requests in flight)."""
        live = self.replicas.live()
        body = {
            "in_flight_requests": len(self.states), "max_in_flight_requests": self.capacity,
            "running_requests": sum(r.running for r in live), "waiting_requests": sum(r.waiting for r in live),
            "clients_in_flight": len(self.per_client),
        }  # fmt: skip
        problem, _ = self.liveness()
        if problem is None and len(self.states) >= self.capacity:
            problem = f"the server is full ({len(self.states)} requests in flight, at most {self.capacity})"
        return problem, body

    def _who(self, index: int) -> str:
        return "the scheduler" if len(self.replicas) == 1 else f"scheduler replica {index}"

    def _check_backlog(self, call: Call) -> None:
        """A streamed call whose reader fell too far behind is aborted as failed."""
        most = self.limits.max_stream_backlog
        if call.queue.qsize() <= most * len(call.states):
            return
        message = f"the stream was aborted: more than {most} unread chunks per request (--max-stream-backlog)"
        live = [s for s in call.states if not s.done]
        for state in live:
            state.error = (503, message)
        self.abort([s.rid for s in live], message)

    def _forget(self, state: RequestState) -> None:
        """Releases the request's replica load and client slot; the tracking entry goes last."""
        if self.states.get(state.rid) is not state:
            return
        self.replicas.finished(state.replica)
        _take(self.per_client, state.client, 1)
        _take(self.client_tokens, state.client, state.prompt_tokens)
        del self.states[state.rid]

    def _fail(self, state: RequestState, message: str, status: int) -> None:
        state.done = True
        self._forget(state)
        event = Event(state.index, error=message, status=status)
        state.call.queue.put_nowait(event)
        self._observe(state, event, None)

    def scheduler_died(self, reason: str) -> None:
        """Fails everything in flight; later calls fail at once."""
        for replica in self.replicas.live():
            self.replica_died(replica.index, reason)
        self.dead = reason

    def replica_died(self, index: int, reason: str) -> None:
        """Fails the requests and control round trips of that replica; the router sends no
        more there. With none left, the manager is dead."""
        self.replicas.mark_dead(index, reason)
        self._fail_replica(index, reason)
        if not self.replicas.live():
            self.dead = reason

    def _fail_replica(self, index: int, reason: str) -> None:
        """Fails (503) the requests and control round trips of one replica."""
        for state in [s for s in self.states.values() if s.replica == index]:
            self._fail(state, reason, 503)
        for replica, future in self.replies.values():
            if replica == index and not future.done():
                future.set_exception(SchedulerUnavailable(reason))

    def close(self) -> None:
        self.replicas.close()
        self.receiver.close(linger=0)


def _take(counts: dict[str, int], key: str, n: int) -> None:
    """Counts down a client's count; the entry goes at zero."""
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
