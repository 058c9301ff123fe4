"""The scheduler process: EngineCore (model, KV pool, radix cache, grammars) behind two
ZeroMQ sockets. The same core as the offline Engine; only the I/O differs.

The loop: drain incoming messages without blocking, step while there is work, block on
the socket when idle (at most HEARTBEAT_S: the loop sends a Heartbeat that often, so the
front end can tell a stuck step from an idle scheduler; with --tp, the ranks are checked as
often, and a lost rank fails every request and ends the process). A request the core refuses is answered with `RequestFailed`; the
process never dies for a bad request. Failures that belong to one request (its row in a
step, its output processing here) fail that request only (`RequestFailed`, 400 for an
invalid request such as a constraint that does not compile, 500 otherwise); a failing
forward pass is rolled back and retried by the core (scheduler/faults.py).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import threading
import time
import traceback

import zmq

from spruce.runtime.core.request import Req
from spruce.runtime.core.update import Reporter, ReqUpdate
from spruce.runtime.errors import InvalidRequestError
from spruce.runtime.executor.distributed import RankLost
from spruce.runtime.protocol.ipc import (
    HEARTBEAT_S,
    UPDATE_FAILED,
    AbortRequests,
    ControlReply,
    ControlRequest,
    Heartbeat,
    NewRequests,
    Ready,
    RequestFailed,
    StartupFailed,
    StepOutput,
    decode,
    encode,
)

logger = logging.getLogger("spruce.scheduler")
MAX_CONSECUTIVE_STEP_ERRORS = 3
PARENT_CHECK_S = 0.5


def run_scheduler(options: dict, inbox: str, outbox: str, log_level: str, replica: int = 0) -> None:
    """Entry point of the spawned process: load the model, say Ready, serve until told to stop.
    `replica`: this scheduler's index under --dp, written into every message it sends."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole group; the front end drains
    watch_parent(os.getppid(), os.path.dirname(inbox.removeprefix("ipc://")))
    context = zmq.Context()
    receiver = context.socket(zmq.PULL)
    receiver.connect(inbox)
    sender = context.socket(zmq.PUSH)
    sender.connect(outbox)
    core = _load_core(options, sender, replica)
    if core is None:
        sender.close(linger=2000)
        raise SystemExit(1)
    freeze_heap()
    sender.send(encode(_ready(core, replica)))
    try:
        SchedulerLoop(core, receiver, sender, replica).run()
    finally:
        core.close()  # stops the grammar build workers
        sender.close(linger=1000)
        receiver.close(linger=0)
        context.term()


def freeze_heap() -> None:
    """Moves everything loaded so far (the model's modules, the tokenizer, the vocabulary
    trie) out of the garbage collector's reach: a full collection walked all of it, a
    100-190 ms pause for every request in flight, every few hundred requests."""
    gc.collect()
    gc.freeze()


def watch_parent(parent_pid: int, ipc_dir: str) -> None:
    """Exits this process when the parent is gone (even if it was SIGKILLed): no orphans,
    and no socket folder left behind."""

    def check() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                logger.error("the server's front-end process is gone; the scheduler exits")
                shutil.rmtree(ipc_dir, ignore_errors=True)
                os._exit(1)

    threading.Thread(target=check, name="spruce-parent-watch", daemon=True).start()


def _load_core(options: dict, sender: zmq.Socket, replica: int = 0):
    from spruce.runtime.config import EngineConfig
    from spruce.runtime.engine.core import EngineCore

    try:
        return EngineCore(EngineConfig.from_options(**options))
    except Exception as e:  # noqa: BLE001 - each load failure goes to the launcher as a message
        logger.error("the scheduler could not start: %s", e)
        sender.send(encode(StartupFailed(f"{type(e).__name__}: {e}", replica)))
        return None


def _ready(core, replica: int = 0) -> Ready:
    return Ready(
        model_name=core.loaded.name,
        model_path=core.loaded.path,
        context_length=core.context_len,
        vocab_size=core.vocab_size,
        kv_slots=core.runner.pool.capacity,
        config=core.config.to_dict(),
        hidden_size=core.loaded.config.hidden_size,
        replica=replica,
    )


class SchedulerLoop:
    def __init__(self, core, receiver: zmq.Socket, sender: zmq.Socket, replica: int = 0) -> None:
        self.core = core
        self.replica = replica
        self.receiver = receiver
        self.sender = sender
        self.tracked: dict[str, Reporter] = {}  # what each request was told so far
        self.stopping = False
        self.step_errors = 0
        self.beat_at = 0.0
        self.handlers = {
            NewRequests: self._on_new,
            AbortRequests: self._on_abort,
            ControlRequest: self._on_control,
        }

    def run(self) -> None:
        try:
            while not self.stopping:
                self._drain(block=not self.core.has_work())
                if self.core.has_work() and not self.stopping:
                    self._step()
                self._beat()
        except RankLost as e:  # --tp: a rank is gone; the group cannot compute any more
            self._fail_all(str(e), 503)
            raise SystemExit(1) from None  # the front end sees the exit: unhealthy, shuts down
        logger.info("scheduler stopped")

    def _beat(self) -> None:
        """A Heartbeat every HEARTBEAT_S from the loop itself (a stuck step sends none);
        with --tp, the ranks are checked as often."""
        now = time.monotonic()
        if now - self.beat_at >= HEARTBEAT_S:
            self.beat_at = now
            self.core.check_ranks()
            self._send(Heartbeat())

    # -- incoming -----------------------------------------------------------------------

    def _drain(self, block: bool) -> None:
        """The messages waiting; when idle, first waits up to HEARTBEAT_S for one."""
        if block and not self.receiver.poll(int(HEARTBEAT_S * 1000)):
            return
        while True:
            try:
                frame = self.receiver.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode(frame)
            self.handlers[type(msg)](msg)

    def _on_new(self, msg: NewRequests) -> None:
        """The front end validated each request (core.validation); it is trusted here."""
        for new in msg.requests:
            try:
                req = self.core.add_request(new.request, rid=new.rid)
                req.client = new.client  # its share of prefill (scheduler/prefill.py)
            except InvalidRequestError as e:
                self._send(RequestFailed(new.rid, str(e), 400))
                continue
            except Exception:  # a bug, not the request's fault: answer it, keep serving
                logger.exception("could not add request %s", new.rid)
                message = "internal error while adding the request (see the server log)"
                self._send(RequestFailed(new.rid, message, 500))
                continue
            self.tracked[new.rid] = Reporter(req)

    def _on_abort(self, msg: AbortRequests) -> None:
        for rid in msg.rids:
            if rid in self.tracked:
                self.core.abort(rid, msg.message)

    def _on_control(self, msg: ControlRequest) -> None:
        try:
            data = self._control(msg.command)
        except InvalidRequestError as e:
            self._send(ControlReply(msg.id, ok=False, error=str(e)))
            return
        except Exception:
            logger.exception("control command %r failed", msg.command)
            self._send(
                ControlReply(
                    msg.id, ok=False, error=f"internal error in {msg.command} (see the server log)"
                )
            )
            return
        self._send(ControlReply(msg.id, ok=True, data=data))

    def _control(self, command: str) -> dict:
        if command == "ping":
            return {}
        if command == "stats":
            return self.core.stats()
        if command == "flush_cache":
            self.core.flush_cache()
            return {"flushed": True}
        if command == "shutdown":
            self.stopping = True
            return {}
        raise InvalidRequestError(f"unknown control command {command!r}")

    # -- stepping -----------------------------------------------------------------------

    def _step(self) -> None:
        try:
            changed = self.core.step()
        except RankLost:
            raise
        except Exception:  # noqa: BLE001 - a core bookkeeping bug: fail what is in flight, serve on
            self._on_step_error(traceback.format_exc())
            return
        self.step_errors = 0
        updates = [u for u in map(self._guarded_update, changed) if u is not None]
        if updates:
            self._send_updates(updates)
        for req in changed:  # last: a finished request's final message is on its way
            if req.finished:
                self.tracked.pop(req.rid, None)

    def _send_updates(self, updates: list[ReqUpdate]) -> None:
        """One StepOutput; if it cannot be encoded, one per request, and a request whose
        own update cannot be sent fails alone."""
        scheduler = self.core.scheduler
        queues = len(scheduler.running), len(scheduler.waiting)
        try:
            self._send(StepOutput(updates, *queues))
            return
        except Exception:
            logger.exception("a step output could not be sent; sending its updates one by one")
        for update in updates:
            try:
                self._send(StepOutput([update], *queues))
            except Exception:
                logger.exception("the update of request %s could not be sent", update.rid)
                self._fail_update(update.rid, finished=update.finished is not None)

    def _guarded_update(self, req: Req) -> ReqUpdate | None:
        """The request's update. If making it raises (its finish report, its logprobs...),
        that request alone fails: its client gets a final error naming no internals. A
        finished request stays tracked until its final message is sent (`_step`)."""
        if req.rid not in self.tracked:
            return None
        try:
            return self._update(req)
        except Exception:
            logger.exception("the update of request %s failed", req.rid)
            self._fail_update(req.rid, req.finished)
            return None

    def _fail_update(self, rid: str, finished: bool) -> None:
        """The request's output could not be sent: a final error instead, then it is
        aborted (if still running) and no longer tracked."""
        self._send(RequestFailed(rid, UPDATE_FAILED, 500))
        if not finished:
            self.core.abort(rid, "its output could not be sent")
        self.tracked.pop(rid, None)

    def _update(self, req: Req) -> ReqUpdate | None:
        """The request's update: a streaming one's each step, any other's once finished;
        a request the runtime failed gets its error instead."""
        if req.finished and req.error is not None:  # its constraint, a fault of its own
            status = 400 if isinstance(req.error, InvalidRequestError) else 500
            self._send(RequestFailed(req.rid, str(req.error), status))
            return None
        if not req.finished and not req.options.stream:
            return None
        return self.tracked[req.rid].update()

    def _on_step_error(self, trace: str) -> None:
        """Last resort, for a bug in the scheduler's own bookkeeping (request faults and
        failing forward passes never get here): fail everything in flight; the aborts free
        their slots at the next step. Repeated failures mean a broken state: exit, so the
        server goes down (and is restarted) rather than answering wrongly."""
        self.step_errors += 1
        logger.error(
            "a scheduler step failed; failing %d request(s):\n%s", len(self.tracked), trace
        )
        self._fail_all("internal error in the scheduler (see the server log)", 500)
        if self.step_errors >= MAX_CONSECUTIVE_STEP_ERRORS:
            raise RuntimeError("the scheduler failed repeatedly; exiting")

    def _fail_all(self, message: str, status: int) -> None:
        """Every request in flight fails with `message`; the aborts free their slots."""
        for rid in list(self.tracked):
            self._send(RequestFailed(rid, message, status))
            self.core.abort(rid, "failed")
        self.tracked.clear()

    def _send(self, msg) -> None:
        msg.replica = self.replica
        self.sender.send(encode(msg))
