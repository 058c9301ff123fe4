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

The same workers check llguidance builds (`GrammarCheck`): the grammar compiled for the
vocabulary and its first mask, where a grammar's cost shows (llguidance_build.py), under
the deadline and the memory cap; the parent compiles only a grammar that passed.

Protocol over two inherited pipes (multiprocessing.connection framing): the worker says
"ready" once its imports are done, then answers each request with ("ok", NFA,
ConstraintSpec or None), ("error", message), ("refused", message: the backend cannot take
it) or ("crash", message).

Trust: pickle is used only on these two anonymous pipes (`os.pipe`, inherited by the one
child this process spawned), never on a socket or a file. Both ends are this module; what
crosses is objects our own code built (a regex, schema or grammar string, the NFA's lists of ints, a
ConstraintSpec, whose grammar is llguidance's text, the model's vocabulary as bytes), so a user's constraint (a schema, a
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
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from spruce.constrained.core.errors import ConstraintError, GrammarRefused

if TYPE_CHECKING:
    from spruce.constrained.backends.llguidance_build import TokenTable

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


@dataclass(frozen=True, slots=True)
class GrammarCheck:
    """An llguidance grammar to compile for the vocabulary, with its first mask: what can
    take long or grow large in its build (llguidance_build.check_build). `table` is sent to
    a worker once; after that the request carries its key alone (`table` None)."""

    grammar: str  # llguidance's grammar text
    kind: str  # the constraint's kind (lark, ebnf, json_schema, ...), for its messages
    table_key: str
    table: TokenTable | None = None

    @property
    def describe(self) -> str:
        return f"{self.kind} {_short(self.grammar)}"


Request = BuildRequest | ConvertRequest | GrammarCheck
POLL_S = 0.05  # how often a waiting job looks at its stop event


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
        self.tables: set[str] = set()  # the keys of the vocabulary tables it was sent

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

    def run(
        self, request: Request, timeout_s: float, stop: threading.Event | None = None
    ) -> object:
        """Raises WorkerGone if the worker was dead before the job started. `stop`, once
        set, ends the job as its deadline does (the worker is killed)."""
        self._wait_ready()
        start = time.monotonic()
        self.jobs += 1
        try:
            self._send.send_bytes(dumps(self._lighter(request)))
        except OSError:
            self.kill()
            raise WorkerGone from None
        kind, payload = self._receive(request, start, timeout_s, stop)
        if kind == "error":
            raise ConstraintError(payload)
        if kind == "refused":  # the backend cannot take it (auto may try the next one)
            raise GrammarRefused(payload)
        if kind == "crash":  # a bug, not the request's fault: the caller logs it as such
            raise RuntimeError(f"the grammar worker failed: {payload}")
        return payload

    def _lighter(self, request: Request) -> Request:
        """The request as sent: a vocabulary table this worker has is sent as its key."""
        if not isinstance(request, GrammarCheck) or request.table is None:
            return request
        if request.table_key in self.tables:
            return replace(request, table=None)
        self.tables.add(request.table_key)
        return request

    def _receive(
        self, request: Request, start: float, timeout_s: float, stop: threading.Event | None
    ) -> tuple[str, object]:
        """The worker's next message, within `timeout_s` of `start` and before `stop` is
        set (else it is killed)."""
        while not self._recv.poll(min(POLL_S, max(0.0, start + timeout_s - time.monotonic()))):
            if (stop is not None and stop.is_set()) or time.monotonic() >= start + timeout_s:
                self.kill()
                raise ConstraintError(
                    f"constraint not {_verb(request)} within {timeout_s:g} s (the work was "
                    f"stopped): {request.describe}"
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

    def run(
        self, request: Request, timeout_s: float, stop: threading.Event | None = None
    ) -> object:
        for _ in range(2):  # an idle worker may have died meanwhile: once more, fresh
            worker = self._take()
            try:
                return worker.run(request, timeout_s, stop)
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


def _verb(request: Request) -> str:
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
        send.send_bytes(dumps(_answer(request)))


def _answer(request: Request) -> tuple[str, object]:
    if isinstance(request, ConvertRequest):
        return _convert(request)
    if isinstance(request, GrammarCheck):
        return _check(request)
    return _build(request)


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


_tokenizers: dict[str, object] = {}  # table key -> llguidance's tokenizer (the last one kept)


def _check(request: GrammarCheck) -> tuple[str, object]:
    from spruce.constrained.backends.llguidance_build import check_build, tokenizer_of

    try:
        tokenizer = _tokenizers.get(request.table_key)
        if tokenizer is None:
            if request.table is None:
                return "crash", "a grammar check without its vocabulary table"
            _tokenizers.clear()
            tokenizer = _tokenizers[request.table_key] = tokenizer_of(request.table)
        check_build(request.grammar, tokenizer, request.kind)
    except GrammarRefused as e:
        return "refused", str(e)
    except ConstraintError as e:
        return "error", str(e)
    except MemoryError:
        return "error", "the grammar build ran out of its memory cap; simplify the constraint"
    except Exception as e:  # noqa: BLE001 - a bug: reported, the worker lives on
        return "crash", f"{type(e).__name__}: {e}"
    return "ok", None


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
