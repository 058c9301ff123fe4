"""Grammar builds in a child process that can be stopped: a constraint's regex is turned into
its byte-level NFA (byte_nfa.py) in a worker process with a memory cap (RLIMIT_AS); a
build past its deadline is ended by killing the worker, and the next build starts a fresh
one. The NFA is linear in the regex's expanded size (capped), so a build takes milliseconds
to about a second; the worker guards against what the caps miss. A worker is replaced
after MAX_JOBS_PER_WORKER jobs or once its address space passes half its cap, so what
earlier builds left behind never makes a later one fail on the cap. The DFA and the token
masks are made lazily in the parent, as requests need them (grammar.py).

Why a `subprocess` (`python -m spruce.constrained.build_worker`) and not multiprocessing:
the server's scheduler runs in a daemonic multiprocessing child, which multiprocessing does
not let start children, and a fresh interpreter imports only this module's few dependencies
(no torch, no re-import of the parent's `__main__`).

The same workers convert JSON schemas to regexes (`ConvertRequest`, see `convert.py`): the
front door's conversion of a pathological schema (thousands of properties, `$ref`s that
unroll exponentially) is stopped at its deadline the same way, wherever the front end runs.

Protocol over two inherited pipes (multiprocessing.connection framing): the worker says
"ready" once its imports are done, then answers each request with ("ok", NFA or
ConstraintSpec), ("error", message) or ("crash", message).

Trust: pickle is used only on these two anonymous pipes (`os.pipe`, inherited by the one
child this process spawned), never on a socket or a file. Both ends are this module; what
crosses is objects our own code built (a regex, schema or grammar string, the NFA's lists of ints, a
ConstraintSpec, whose grammar is llguidance's text), so a user's constraint (a schema, a
regex, a grammar, a structural tag) is only ever pickled as a string, never unpickled
from bytes they chose.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from spruce.constrained.core.errors import ConstraintError

STARTUP_TIMEOUT_S = 60.0  # a fresh interpreter importing its modules on a loaded machine
# A worker is replaced after this many jobs, or once its address space passes this share of
# its memory cap: Python keeps what a large build freed (fragmented arenas), so a reused
# worker's footprint only grows, until a later large build fails on the cap.
MAX_JOBS_PER_WORKER = 64
RECYCLE_SHARE_OF_CAP = 0.5


@dataclass(frozen=True, slots=True)
class BuildRequest:
    regex: str  # the constraint's regex

    @property
    def describe(self) -> str:
        return _short(self.regex)


@dataclass(frozen=True, slots=True)
class ConvertRequest:
    """One constraint to check and turn into its spec: a JSON schema (as JSON text, already
    parsed once by the parent), or a long regex or list of choices (parsing them is linear
    but Python-bound: done here, it never holds the front end's interpreter)."""

    kind: str  # json_schema | regex | choices | ebnf | lark | structural_tag
    text: str  # the schema's JSON text, the regex, the choices as a JSON list, the grammar text
    whitespace_pattern: str = ""
    schema_mode: str = "lenient"  # lenient | strict
    backend: str = "auto"  # the grammar backend (constrained/backends/__init__.py)
    check: bool = False  # make_spec's `check`
    schema_options: dict | None = None  # a SchemaOptions as a dict (its mode and whitespace: above)

    @property
    def describe(self) -> str:
        return f"{self.kind} {_short(self.text)}"


def dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> object:
    return pickle.loads(data)  # noqa: S301 - only from this module's own pipes (see Trust above)


# -- the parent's handle on one worker --------------------------------------------------------------


class BuildWorker:
    """One worker process. `run` sends a request and waits until the deadline; past it
    (or if the worker dies, e.g. on its memory cap) the worker is killed and a
    ConstraintError raised. Not thread-safe: one job at a time (see WorkerPool)."""

    def __init__(self, memory_mb: int) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        fds = (str(to_child_r), str(from_child_w))
        cmd = [sys.executable, "-m", "spruce.constrained.build_worker", *fds, str(memory_mb)]
        try:
            self.proc = subprocess.Popen(
                cmd, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self.memory_mb = memory_mb
        self.ready = False  # the worker says when its imports are done
        self.jobs = 0  # requests sent

    @property
    def worn(self) -> bool:
        """Due for replacement (see MAX_JOBS_PER_WORKER, RECYCLE_SHARE_OF_CAP)."""
        if self.jobs >= MAX_JOBS_PER_WORKER:
            return True
        size = address_space_mb(self.proc.pid)
        return (
            self.memory_mb > 0 and size is not None and size > RECYCLE_SHARE_OF_CAP * self.memory_mb
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: BuildRequest | ConvertRequest, timeout_s: float) -> object:
        """Raises WorkerGone if the worker was dead before the job started."""
        self._wait_ready()
        start = time.monotonic()
        self.jobs += 1
        try:
            self._send.send_bytes(dumps(request))
        except OSError:
            self.kill()
            raise WorkerGone from None
        kind, payload = self._receive(request, start, timeout_s)
        if kind == "error":
            raise ConstraintError(payload)
        if kind == "crash":  # a bug, not the request's fault: the caller logs it as such
            raise RuntimeError(f"the grammar worker failed: {payload}")
        return payload

    def _receive(
        self, request: BuildRequest | ConvertRequest, start: float, timeout_s: float
    ) -> tuple[str, object]:
        """The worker's next message, within `timeout_s` of `start` (else it is killed)."""
        if not self._recv.poll(max(0.0, start + timeout_s - time.monotonic())):
            self.kill()
            raise ConstraintError(
                f"constraint not {_verb(request)} within {timeout_s:g} s (the work was stopped): "
                f"{request.describe}"
            )
        try:
            return loads(self._recv.recv_bytes())
        except (EOFError, OSError):
            self.kill()
            raise ConstraintError(
                f"the grammar worker stopped after {time.monotonic() - start:.1f} s (out of its "
                f"{self.memory_mb} MB memory cap, or crashed): {request.describe}; "
                "simplify the constraint"
            ) from None

    def _wait_ready(self) -> None:
        """A fresh worker first imports its modules: that time is not the build's."""
        if self.ready:
            return
        try:
            ready = self._recv.poll(STARTUP_TIMEOUT_S) and self._recv.recv_bytes() == b"ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise WorkerGone
        self.ready = True

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        self._send.close()
        self._recv.close()


class WorkerGone(Exception):
    """The worker process died before a build started (the pool starts another)."""


class WorkerPool:
    """Idle workers kept for reuse (at most `size`); a killed, dead or worn one (see
    BuildWorker.worn) is dropped and the next build starts a fresh process. Thread-safe."""

    def __init__(self, memory_mb: int, size: int) -> None:
        self.memory_mb = memory_mb
        self.size = size
        self._idle: list[BuildWorker] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, request: BuildRequest | ConvertRequest, timeout_s: float) -> object:
        for _ in range(2):  # an idle worker may have died meanwhile: once more, fresh
            worker = self._take()
            try:
                return worker.run(request, timeout_s)
            except WorkerGone:
                continue
            finally:
                self._give_back(worker)
        raise ConstraintError("the grammar build worker could not be started (see the log)")

    def _take(self) -> BuildWorker:
        with self._lock:
            if self._closed:
                raise ConstraintError("the grammar compiler is closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
        return BuildWorker(self.memory_mb)

    def _give_back(self, worker: BuildWorker) -> None:
        with self._lock:
            if (
                worker.alive
                and not self._closed
                and len(self._idle) < self.size
                and not worker.worn
            ):
                self._idle.append(worker)
                return
        worker.kill()

    def start(self, count: int = 1) -> None:
        """Starts workers ahead of the first build (their imports take a moment)."""
        workers = [BuildWorker(self.memory_mb) for _ in range(count)]
        for worker in workers:
            self._give_back(worker)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


def address_space_mb(pid: int) -> float | None:
    """A process's address space (what RLIMIT_AS caps), None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _short(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")


def _verb(request: BuildRequest | ConvertRequest) -> str:
    return "converted" if isinstance(request, ConvertRequest) else "compiled"


# -- the worker process ------------------------------------------------------------------------------


# Workers run user-controlled work (a pathological schema or regex); below the serving
# processes' priority, so on a busy machine decoding for everyone else wins the CPU.
WORKER_NICENESS = 10


def _serve(receive: Connection, send: Connection, memory_mb: int) -> None:
    if memory_mb > 0:
        cap = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from spruce.constrained import spec  # noqa: F401 - imported before "ready"
    from spruce.constrained.automaton import byte_nfa  # noqa: F401

    send.send_bytes(b"ready")
    while True:
        try:
            request = loads(receive.recv_bytes())
        except EOFError:  # the parent is gone or closed us
            return
        reply = _convert(request) if isinstance(request, ConvertRequest) else _build(request)
        send.send_bytes(dumps(reply))


def _convert(request: ConvertRequest) -> tuple[str, object]:
    from spruce.constrained.schema.schema_context import SchemaOptions
    from spruce.constrained.spec import make_spec

    value = json.loads(request.text) if request.kind == "choices" else request.text
    try:
        options = SchemaOptions(**request.schema_options) if request.schema_options else None
        spec = make_spec(
            **{request.kind: value},
            whitespace_pattern=request.whitespace_pattern,
            schema_mode=request.schema_mode,
            schema_options=options,
            backend=request.backend,
            check=request.check,
        )
    except ConstraintError as e:
        return "error", str(e)
    except RecursionError:
        return "error", f"{request.kind} is nested too deeply" + (
            "; flatten it or use $defs" if request.kind == "json_schema" else ""
        )
    except MemoryError:
        return (
            "error",
            f"converting the {request.kind} ran out of the worker's memory cap; simplify it",
        )
    except Exception as e:  # noqa: BLE001 - a converter bug: reported, the worker lives on
        return "crash", f"{type(e).__name__}: {e}"
    return "ok", spec


def _build(request: BuildRequest) -> tuple[str, object]:
    from spruce.constrained.automaton.byte_nfa import build_nfa

    try:
        return "ok", build_nfa(request.regex)
    except ConstraintError as e:
        return "error", str(e)
    except MemoryError:
        return "error", "the grammar build ran out of its memory cap; simplify the constraint"
    except RecursionError:
        return "error", "the constraint's regex is nested too deeply"


def _watch_parent(parent_pid: int) -> None:
    """Ends this worker when its parent is gone (a build can run long after)."""

    def check() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=check, daemon=True).start()


def main(argv: list[str]) -> None:
    """The worker's entry point: `python -m spruce.constrained.build_worker READ_FD WRITE_FD MEMORY_MB`."""
    os.nice(WORKER_NICENESS)  # first: its start-up (imports) yields to serving too
    _watch_parent(os.getppid())
    read_fd, write_fd, memory = (int(a) for a in argv[:3])
    _serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False), memory)


if __name__ == "__main__":
    # Run as the package module, not as __main__, so pickled classes name their real module.
    from spruce.constrained import build_worker

    build_worker.main(sys.argv[1:])
