"""`spruce serve`: the launcher and front-end process.

Processes (multiprocessing, spawn context, daemon children):

- this process, the front end: HTTP (FastAPI on uvicorn) and the ZeroMQ ROUTER socket for
  DSL clients on one asyncio loop; tokenization, validation and detokenization happen here;
- the scheduler process: EngineCore (model, KV pool, radix cache, grammars); with `--dp N`,
  N of them (replicas), each with its own inbox, all pushing to the one front-end socket;
  the request manager routes each request to one (replicas.py, router.py). A replica that
  dies fails only its own requests (503) and the others keep serving, unless
  --exit-on-replica-death; the server exits when none is left;
- with `--tp N`, the scheduler process is tensor-parallel rank 0 and starts this machine's
  other ranks (engine/tp_worker.py). On another machine (`--node-rank 1 ...`), or as a rank
  other than 0 under torchrun, `spruce serve` runs only that machine's follower ranks.

They exchange the typed messages of protocol/ipc.py over ipc:// sockets in a private
folder. A watchdog here notices a dead scheduler at once (its process sentinel); the
scheduler exits by itself when this process disappears. The front end's own tasks run
under a Supervisor (restarted when they fail; /health reports it; the server exits when
one keeps failing). Without --api-key the ZeroMQ port only binds to a loopback address
(unless --allow-unauthenticated-zmq). HTTP's doors (http/middleware.py, http/connections.py):
the Host header must name this server, --max-connections, --header-timeout-s. SIGINT / SIGTERM: stop accepting, give
in-flight requests `--shutdown-timeout-s`, abort the rest, stop the scheduler, exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time

import uvicorn
import zmq
import zmq.asyncio

from spruce.constrained.convert import Conversion
from spruce.runtime.config import ServerOptions
from spruce.runtime.core.validation import ModelLimits
from spruce.runtime.errors import ModelLoadError, SpruceError
from spruce.runtime.limits import ServingLimits
from spruce.runtime.protocol.ipc import Ready, StartupFailed, decode
from spruce.runtime.server.metrics import Metrics
from spruce.runtime.server.native import ModelContext
from spruce.runtime.server.request_manager import RequestManager, SchedulerUnavailable
from spruce.runtime.server.supervisor import Supervisor
from spruce.runtime.server.work_pool import FrontPools
from spruce.runtime.server.zmq_frontend import ZmqFrontend

logger = logging.getLogger("spruce.server")
ABORT_FLUSH_S = 3.0  # after aborting what is left at shutdown: time for the aborts to land
CHILD_EXIT_S = 5.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class StartupError(SpruceError):
    """The server could not start (port in use, model not loadable...)."""


def serve(options: ServerOptions, engine_options: dict) -> int:
    """Runs the server until SIGINT / SIGTERM or a dead child; returns the exit code."""
    if is_follower_rank(engine_options):
        return run_follower_rank(engine_options)
    if options.dp > 1 and engine_options.get("dist_init_addr"):
        raise StartupError(
            "--dp > 1 runs each replica's --tp ranks on this machine: drop --dist-init-addr"
        )
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    ipc_dir = tempfile.mkdtemp(prefix="spruce-")  # 0700: no other user can reach the sockets
    try:
        return asyncio.run(Launcher(options, engine_options, ipc_dir).run())
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def is_follower_rank(engine_options: dict) -> bool:
    """A tensor-parallel process that is not rank 0: torchrun's RANK, or --node-rank > 0."""
    if engine_options.get("tp_size", 1) <= 1:
        return False
    if "RANK" in os.environ:
        return os.environ["RANK"] != "0"
    return engine_options.get("node_rank", 0) > 0


def run_follower_rank(engine_options: dict) -> int:
    """This machine's (or torchrun process's) follower ranks, until rank 0 stops them."""
    from spruce.runtime.config import EngineConfig
    from spruce.runtime.engine.tp_worker import place, run_follower

    config = EngineConfig.from_options(**engine_options)
    where = place(config)
    logger.info(
        "tensor-parallel rank %d of %d: following rank 0 (no front end)", where.rank, where.world
    )
    run_follower(config, where)
    return 0


class _Uvicorn(uvicorn.Server):
    """The launcher owns SIGINT / SIGTERM (it drains requests and stops the scheduler)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


class Launcher:
    def __init__(self, options: ServerOptions, engine_options: dict, ipc_dir: str) -> None:
        self.options = options
        self.engine_options = engine_options
        if options.dp < 1:
            raise StartupError(f"--dp must be at least 1, not {options.dp}")
        self.to_schedulers = [f"ipc://{ipc_dir}/to_scheduler_{i}" for i in range(options.dp)]
        self.from_scheduler = f"ipc://{ipc_dir}/from_scheduler"
        self.context = zmq.asyncio.Context()
        self.schedulers: list[multiprocessing.Process] = []  # one per replica
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self.draining = False  # set on shutdown: new requests get 503
        self.drain_task: asyncio.Future | None = None  # held so the loop cannot drop it
        self.http: _Uvicorn | None = None
        self.guard = None  # the HTTP app's outer layer; serves 503 until the model is loaded
        self.zmq: ZmqFrontend | None = None
        self.manager: RequestManager | None = None
        self.model: ModelContext | None = None
        self.supervisor = Supervisor(self._give_up)

    # -- start --------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_shutdown, sig)
        router = _router(self.options)
        http_socket = _bind_http(self.options.host, self.options.port)
        self.zmq = _bind_zmq(self.context, self.options)
        senders, receiver = self._scheduler_sockets()
        http_task = self._start_http(http_socket)  # answers 503 until the model is loaded
        try:
            self._start_schedulers()
            ready = await self._wait_ready(receiver)
            if ready is not None:
                await self._serve(ready, senders, receiver, router)
        finally:
            self.http.should_exit = True
            await http_task
            tasks = self.supervisor.tasks
            for name, task in tasks.items():  # all but the receiver, which the shutdown reply needs
                if name != "receiver":
                    task.cancel()
            await self._stop_scheduler()
            if "receiver" in tasks:
                tasks["receiver"].cancel()
            self.zmq.close()
            if self.model is not None:
                self.model.pools.close()
            http_socket.close()
            for sender in senders:
                sender.close(linger=0)
            receiver.close(linger=0)
            self.context.term()
        return self.exit_code

    def _start_http(self, http_socket: socket.socket) -> asyncio.Task:
        from spruce.runtime.server.http.middleware import GuardMiddleware

        self.guard = GuardMiddleware(self.options, self)
        app = self.guard
        if self.options.origins:  # outside the guard: a CORS preflight carries no API key
            from starlette.middleware.cors import CORSMiddleware

            app = CORSMiddleware(
                self.guard, allow_origins=self.options.origins, allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )  # fmt: skip
        grace = self.options.shutdown_timeout_s + ABORT_FLUSH_S + 1  # then open connections are cut
        self.http = _Uvicorn(http_config(app, self.options.serving_limits, grace))
        return asyncio.ensure_future(self.http.serve(sockets=[http_socket]))

    def _scheduler_sockets(self):
        senders = []
        for address in self.to_schedulers:
            sender = zmq.Context.instance().socket(zmq.PUSH)
            sender.setsockopt(zmq.SNDHWM, 0)
            sender.bind(address)
            senders.append(sender)
        receiver = self.context.socket(zmq.PULL)
        receiver.bind(self.from_scheduler)
        return senders, receiver

    def _start_schedulers(self) -> None:
        from spruce.runtime.server.scheduler_process import run_scheduler

        level = self.engine_options.get("log_level") or logging.getLevelName(
            logging.getLogger().level
        )
        spawn = multiprocessing.get_context("spawn")
        for replica, inbox in enumerate(self.to_schedulers):
            name = "spruce-scheduler" if self.options.dp == 1 else f"spruce-scheduler-{replica}"
            args = (self.engine_options, inbox, self.from_scheduler, str(level), replica)
            proc = spawn.Process(target=run_scheduler, args=args, name=name, daemon=True)
            proc.start()
            self.schedulers.append(proc)
            folder = os.path.dirname(inbox.removeprefix("ipc://"))
            logger.info("scheduler process %d started (%s; sockets in %s); loading the model",
                        proc.pid, name, folder)  # fmt: skip

    async def _wait_ready(self, receiver) -> Ready | None:
        """Every replica's Ready (the first one's is returned), or a StartupError."""
        deadline = time.monotonic() + self.options.startup_timeout_s
        ready: dict[int, Ready] = {}
        while not self.stopping.is_set() and len(ready) < len(self.schedulers):
            if await receiver.poll(200):
                msg = decode(await receiver.recv())
                if isinstance(msg, Ready):
                    ready[msg.replica] = msg
                if isinstance(msg, StartupFailed):
                    raise StartupError(f"the model could not be loaded: {msg.message}")
            elif any(not p.is_alive() for p in self.schedulers):
                code = next(p.exitcode for p in self.schedulers if not p.is_alive())
                raise StartupError(
                    f"the scheduler process exited while starting (exit code {code})"
                )
            elif time.monotonic() > deadline:
                raise StartupError(
                    f"the model did not load within {self.options.startup_timeout_s:g} s"
                )
        return ready.get(0) if len(ready) == len(self.schedulers) else None

    async def _serve(self, ready: Ready, senders, receiver, router) -> None:
        from spruce.runtime.models.loading.files import load_tokenizer
        from spruce.runtime.server.app import build_app
        from spruce.runtime.server.scheduler_process import (
            freeze_heap,  # imported already: it started the schedulers
        )

        tokenizer = await asyncio.to_thread(load_tokenizer, ready.model_path)
        _set_chat_formats(tokenizer, self.options)
        name = self.options.served_model_name or ready.model_name
        c = ready.config["constraint"]
        conversion = Conversion(c["grammar_whitespace_pattern"] or "", c["grammar_timeout_s"],
                                c["grammar_memory_mb"], c["grammar_backend"])  # fmt: skip
        limits = ModelLimits(
            ready.vocab_size, ready.context_length, self.options.request_limits, conversion,
            ready.hidden_size, tokenizer.token_bound,
        )  # fmt: skip
        pools = FrontPools(self.options.serving_limits.retry_after_s)
        model = self.model = ModelContext(tokenizer, name, ready.model_path, limits, pools)
        metrics = Metrics()
        max_running = ready.config["scheduler"]["max_running_requests"]
        self.manager = RequestManager(
            senders, receiver, tokenizer, observer=metrics, limits=self.options.serving_limits,
            max_running=max_running * len(senders), router=router,
        )  # fmt: skip
        self.zmq.attach(self.manager, model, metrics)
        freeze_heap()  # the tokenizer and the app stay out of full collections
        self.supervisor.on_restart = lambda name: metrics.task_restarts.labels(name).inc()
        self.supervisor.start("receiver", self.manager.receive_forever)
        self.supervisor.start("zmq", self.zmq.serve_forever)
        if self.options.throughput_log_s > 0:

            def stats():
                return self.manager.control("stats", self.options.health_timeout_s)

            def in_flight():
                return self.manager.in_flight

            period = self.options.throughput_log_s
            self.supervisor.start(
                "throughput-log", lambda: metrics.log_throughput(period, stats, in_flight)
            )
        self._watch_schedulers()
        if self.options.parent_pid:
            self.supervisor.start(
                "parent-watch", lambda: self._watch_parent(self.options.parent_pid)
            )
        self.guard.app = build_app(self, model, metrics, ready)
        self._announce(ready, name)
        await self.stopping.wait()  # set once in-flight requests are done or aborted

    def _announce(self, ready: Ready, name: str) -> None:
        host, port = self.options.host, self.options.port
        replicas = (f", {self.options.dp} replicas ({self.options.router_policy} routing)"
                    if self.options.dp > 1 else "")  # fmt: skip
        print(
            f"Spruce server ready: model {name} (context {ready.context_length}, {ready.kv_slots} KV slots{replicas})\n"
            f"  HTTP    http://{host}:{port}  (native: /generate; OpenAI: /v1; /health, /metrics)\n"
            f"  ZeroMQ  {self.zmq.address}",
            flush=True,
        )
        if not self.options.api_key and host not in LOOPBACK_HOSTS:
            logger.warning("no --api-key: HTTP and ZeroMQ on %s accept any client", host)

    # -- watchdog ---------------------------------------------------------------------------

    def _watch_schedulers(self) -> None:
        loop = asyncio.get_running_loop()
        for replica, proc in enumerate(self.schedulers):
            loop.add_reader(proc.sentinel, self._on_scheduler_exit, replica)

    async def _watch_parent(self, pid: int) -> None:
        """The launching process (e.g. sl.Runtime) died without shutting us down: exit."""
        while _alive(pid):
            await asyncio.sleep(0.5)
        logger.error("the launching process %d is gone; the server shuts down", pid)
        self.request_shutdown(None, grace_s=0.0)

    def _give_up(self, reason: str) -> None:
        """A front-end task keeps failing: the server exits rather than half-serve."""
        logger.error("%s; the server shuts down", reason)
        self.exit_code = 1
        self.request_shutdown(None, grace_s=0.0)

    def _on_scheduler_exit(self, replica: int) -> None:
        proc = self.schedulers[replica]
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self.stopping.is_set() and self.draining:
            return  # expected during shutdown
        proc.join(0.1)
        who = ("the scheduler process" if len(self.schedulers) == 1
               else f"scheduler replica {replica} (pid {proc.pid})")  # fmt: skip
        reason = f"{who} exited unexpectedly (exit code {proc.exitcode})"
        self.manager.replica_died(replica, reason)
        if self.manager.dead is None and not self.options.exit_on_replica_death:
            left = len(self.manager.replicas.live())
            logger.error(
                "%s; its requests failed, serving on the %d other replica(s)", reason, left
            )
            return
        logger.error("%s; the server shuts down", reason)
        self.manager.scheduler_died(reason)
        self.exit_code = 1
        self.request_shutdown(None, grace_s=0.0)

    # -- shutdown ---------------------------------------------------------------------------

    def request_shutdown(self, sig: int | None, grace_s: float | None = None) -> None:
        if self.draining:
            if sig == signal.SIGINT:  # a second Ctrl-C: no more waiting
                logger.warning("second interrupt: exiting now")
                self._kill_scheduler()
                os._exit(130)
            return
        self.draining = True
        if sig is not None:
            logger.info("received %s: draining and shutting down", signal.Signals(sig).name)
        grace = self.options.shutdown_timeout_s if grace_s is None else grace_s
        self.zmq.accepting = False
        self.http.should_exit = True  # stop accepting connections; open ones continue
        self.drain_task = asyncio.ensure_future(self._drain(grace))

    async def _drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self._in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.manager is not None and self._in_flight():
            n = self.manager.abort_all("the server is shutting down")
            logger.warning("aborted %d request(s) still running at shutdown", n)
            deadline = time.monotonic() + ABORT_FLUSH_S
            while self._in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.stopping.set()

    def _in_flight(self) -> int:
        return self.manager.in_flight if self.manager is not None else 0

    async def _stop_scheduler(self) -> None:
        """Every live replica is told to stop, then joined (killed past CHILD_EXIT_S)."""
        if not any(p.is_alive() for p in self.schedulers):
            return
        if self.manager is None:  # still loading: nothing to drain
            self._kill_scheduler()
            return
        if not self.manager.dead:
            with contextlib.suppress(SchedulerUnavailable):
                await self.manager.control("shutdown", 2.0)
            self.manager.dead = "the server is shutting down"
        for proc in self.schedulers:
            await asyncio.to_thread(proc.join, CHILD_EXIT_S)
        if any(p.is_alive() for p in self.schedulers):
            logger.warning("a scheduler did not stop in %g s; terminating it", CHILD_EXIT_S)
            self._kill_scheduler()

    def _kill_scheduler(self) -> None:
        for proc in self.schedulers:
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)


def http_config(app, limits: ServingLimits, grace_s: float) -> uvicorn.Config:
    """uvicorn's settings: h11 with a deadline for request headers (--header-timeout-s) and
    at most --max-connections open connections (uvicorn counts the new one too: + 1)."""
    from spruce.runtime.server.http.connections import header_deadline_protocol

    return uvicorn.Config(
        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=grace_s, access_log=False,
        http=header_deadline_protocol(limits.header_timeout_s), limit_concurrency=limits.max_connections + 1,
    )  # fmt: skip


def _router(options: ServerOptions):
    """The --router-policy router over --dp replicas (a ValueError is a StartupError)."""
    from spruce.runtime.scheduler.router import RouterOptions, make_router

    thresholds = RouterOptions(
        options.router_cache_threshold,
        options.router_balance_abs_threshold,
        options.router_balance_rel_threshold,
    )
    try:
        return make_router(options.router_policy, options.dp, thresholds)
    except ValueError as e:
        raise StartupError(str(e)) from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _set_chat_formats(tokenizer, options: ServerOptions) -> None:
    """--chat-template replaces the model's template; the reasoning and tool-call parser
    names are checked (and "auto" resolved) before the first request."""
    from spruce.runtime.server.openai.chat_prompt import startup_formats
    from spruce.runtime.server.openai.tool_parsers import register_plugin
    from spruce.runtime.text.tokenizer import read_chat_template

    try:
        if options.tool_call_parser_plugin:
            register_plugin(options.tool_call_parser_plugin)
        if options.chat_template:
            tokenizer.chat_template = read_chat_template(options.chat_template)
        reasoning, tools = startup_formats(options, tokenizer.chat_template)
    except (ModelLoadError, ValueError) as e:
        raise StartupError(str(e)) from None
    logger.info("chat: reasoning parser %s, tool-call format %s",
                reasoning.name if reasoning else "none", tools.name)  # fmt: skip


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it. asyncio sets it only on sockets made with proto
    # IPPROTO_TCP, and without it a keep-alive response waited ~40 ms for the client's
    # delayed ACK (Nagle) before its body went out.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another port with --port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _bind_zmq(context: zmq.asyncio.Context, options: ServerOptions) -> ZmqFrontend:
    if (options.host not in LOOPBACK_HOSTS and not options.api_key
            and not options.allow_unauthenticated_zmq):  # fmt: skip
        raise StartupError(
            f"refusing to open the ZeroMQ port on {options.host} without authentication: set --api-key "
            "(DSL clients then send it: sl.RuntimeEndpoint(address, api_key=...)), or pass "
            "--allow-unauthenticated-zmq, or listen on 127.0.0.1"
        )
    address = f"tcp://{_zmq_host(options.host)}:{options.zmq_port}"
    try:
        budget = options.serving_limits.max_zmq_bytes_per_client
        return ZmqFrontend(context, address, options.max_request_bytes, options.api_key, budget)
    except zmq.ZMQError as e:
        raise StartupError(
            f"cannot listen on {address} ({e}); pick another port with --zmq-port"
        ) from None


def _zmq_host(host: str) -> str:
    return "*" if host in ("0.0.0.0", "::") else host
