"""Grammar builds in a child process that can be stopped: the outlines-core index and the
interegular character automaton of a regex are built in a worker process with a memory cap
(RLIMIT_AS); a build past its deadline is ended by killing the worker, and the next build
starts a fresh one. The scheduler's process never runs a build, so a pathological regex
(`(a|b)*a(a|b){24}` determinizes to millions of states) can cost a worker, not the server.

Why a `subprocess` (`python -m spruce.constrained.build_worker`) and not multiprocessing:
the server's scheduler runs in a daemonic multiprocessing child, which multiprocessing does
not let start children, and a fresh interpreter imports only this module's few dependencies
(no torch, no re-import of the parent's `__main__`).

The results come back pickled: `outlines_core.Index` pickles through its own binary form
(`Index.__reduce__` -> `Index.from_binary`), so the parent gets the very index the worker
built. But `from_binary` holds the GIL (measured: about 12 ms per MB of binary form, 0.65 s
for the 55 MB index of a 200-character JSON string field with a 49k vocabulary), which
would stall the scheduler loop; the index build itself releases it. So an index larger
than `BuildRequest.max_transfer_bytes` is not sent: the worker's build served as a guard
(it finished within the deadline and the memory cap) and the parent builds it again, off
the GIL, unless the worker's build took so long that a second one would overrun the
deadline (then the GIL hold is the lesser harm). interegular's `anything_else` sentinel is
not a singleton after unpickling, so it travels as a persistent id and comes back as the
parent's object.

The same workers convert JSON schemas to regexes (`ConvertRequest`, see `convert.py`): the
front door's conversion of a pathological schema (thousands of properties, `$ref`s that
unroll exponentially) is stopped at its deadline the same way, wherever the front end runs.

Protocol over two inherited pipes (multiprocessing.connection framing): the parent sends the
outlines `Vocabulary` and its sample (`vocab.VocabularySample` as a plain tuple: the worker
does not import vocab.py, which imports torch) once (None for a worker that only converts
schemas), then one request
per job; the worker answers each with a `BuildResult` / `ConstraintSpec` or an error message.
Before its answer, a build whose index will not be sent says so ("progress"), and the parent
starts its own build then, while the worker finishes the automaton. An index whose
character automaton is not ready `automaton_grace_s` after it goes ahead as progress too
("index_ready", a `BuildResult` without the automaton), so the grammar serves at once; the
answer then brings the automaton alone
(interegular's determinization in Python takes 2-10x the index's time on real schemas:
p50 1.1 s against 0.55 s on 24 of the corpus's schemas). The worker first builds
the index on a sample of the vocabulary (every 16th token and the single bytes: about a
tenth of the full build's time), which proves the regex's automaton finite and small and
estimates the full index's size and build time. An index estimated small enough to send is
built and sent; one estimated within `max_direct_bytes` and `max_rebuild_s` is announced at
once ("index_estimated") and built only by the parent; a larger one is built in full here
first, as the proof ("index_built"), before the parent builds it again. A worker whose
automaton is still running `automaton_wait_s` after the index answers without it and ends
(the thread would hold a core); it marks that answer "last", so the parent sends it nothing
more.

Trust: pickle is used only on these two anonymous pipes (`os.pipe`, inherited by the one
child this process spawned), never on a socket or a file. Both ends are this module; what
crosses is objects our own code built (the vocabulary, a regex string, the built index), so
a user's constraint is only ever pickled as a string, never unpickled from bytes they chose.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from importlib import import_module
from multiprocessing.connection import Connection

from interegular.fsm import anything_else

from spruce.constrained.errors import ConstraintError

_ANYTHING_ELSE_ID = "interegular.anything_else"
STARTUP_TIMEOUT_S = 60.0  # a fresh interpreter importing outlines-core on a loaded machine


@dataclass(frozen=True, slots=True)
class BuildRequest:
    regex: str  # the index regex (patterns.index_regex of the constraint's regex)
    automaton_regex: str  # the constraint's own regex, for the character automaton
    automaton_wait_s: float  # how long to wait for the automaton once the index is built
    max_transfer_bytes: int  # a larger index is built again by the parent (see above)...
    max_rebuild_s: float  # ...unless it took (or is estimated to take) longer than this
    max_direct_bytes: int = 0  # an index estimated up to this size is built by the parent only
    automaton_grace_s: float = 1.0  # an automaton later than this goes after the index ("index_ready")

    @property
    def describe(self) -> str:
        return _short(self.automaton_regex)


@dataclass(frozen=True, slots=True)
class ConvertRequest:
    schema_text: str  # the JSON schema as JSON text (already parsed once by the parent)
    whitespace_pattern: str
    schema_mode: str  # lenient | strict

    @property
    def describe(self) -> str:
        return f"json_schema {_short(self.schema_text)}"


@dataclass(frozen=True, slots=True)
class BuildResult:
    index: object | None  # outlines_core.Index; None: too large to send (build it again), or sent ahead
    char_automaton: object | None  # jump_forward.CharAutomaton; None: jump-forward off
    index_bytes: int  # size of the index's binary form, or its estimate (the cache's budget)
    automaton_bytes: int


# -- pickling with interegular's sentinel ---------------------------------------------------------


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return _ANYTHING_ELSE_ID if obj is anything_else else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid != _ANYTHING_ELSE_ID:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return anything_else


def dumps(obj: object) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> object:
    return _Unpickler(io.BytesIO(data)).load()


# -- the parent's handle on one worker --------------------------------------------------------------


class BuildWorker:
    """One worker process. `run` sends a request and waits until the deadline; past it
    (or if the worker dies, e.g. on its memory cap) the worker is killed and a
    ConstraintError raised. Not thread-safe: one job at a time (see WorkerPool)."""

    def __init__(self, vocabularies: tuple | None, memory_mb: int) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        fds = (str(to_child_r), str(from_child_w))
        cmd = [sys.executable, "-m", "spruce.constrained.build_worker", *fds, str(memory_mb)]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self.memory_mb = memory_mb
        self._send.send_bytes(dumps(vocabularies))
        self.ready = False  # the worker says when its imports are done

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, request: BuildRequest | ConvertRequest, timeout_s: float, on_progress=None) -> object:
        """Raises WorkerGone if the worker was dead before the job started. `on_progress` is
        called with each progress message the worker sends before its answer."""
        self._wait_ready()
        start = time.monotonic()
        try:
            self._send.send_bytes(dumps(request))
        except OSError:
            self.kill()
            raise WorkerGone from None
        kind, payload = self._receive(request, start, timeout_s)
        while kind == "progress":
            if on_progress is not None:
                on_progress(payload)
            kind, payload = self._receive(request, start, timeout_s)
        if kind == "last":  # the worker ends after this answer
            self.kill()
            kind, payload = payload
        if kind == "error":
            raise ConstraintError(payload)
        if kind == "crash":  # a bug, not the request's fault: the caller logs it as such
            raise RuntimeError(f"the grammar worker failed: {payload}")
        return payload

    def _receive(self, request: BuildRequest | ConvertRequest, start: float, timeout_s: float) -> tuple[str, object]:
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
        """A fresh worker first imports outlines-core: that time is not the build's."""
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
    """Idle workers kept for reuse (at most `size`); a killed or dead one is dropped and the
    next build starts a fresh process. Thread-safe."""

    def __init__(self, vocabularies: tuple | None, memory_mb: int, size: int) -> None:
        self.vocabularies = vocabularies  # (Vocabulary, sample Vocabulary, scale); None: conversions only
        self.memory_mb = memory_mb
        self.size = size
        self._idle: list[BuildWorker] = []
        self._lock = threading.Lock()
        self._closed = False

    def run(self, request: BuildRequest | ConvertRequest, timeout_s: float, on_progress=None) -> object:
        for _ in range(2):  # an idle worker may have died meanwhile: once more, fresh
            worker = self._take()
            try:
                return worker.run(request, timeout_s, on_progress)
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
        return BuildWorker(self.vocabularies, self.memory_mb)

    def _give_back(self, worker: BuildWorker) -> None:
        with self._lock:
            if worker.alive and not self._closed and len(self._idle) < self.size:
                self._idle.append(worker)
                return
        worker.kill()

    def start(self, count: int = 1) -> None:
        """Starts workers ahead of the first build (their imports take a moment)."""
        workers = [BuildWorker(self.vocabularies, self.memory_mb) for _ in range(count)]
        for worker in workers:
            self._give_back(worker)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


def _short(regex: str, limit: int = 80) -> str:
    return repr(regex if len(regex) <= limit else regex[:limit] + "...")


def _verb(request: BuildRequest | ConvertRequest) -> str:
    return "converted" if isinstance(request, ConvertRequest) else "compiled"


# -- the worker process ------------------------------------------------------------------------------


def _serve(receive: Connection, send: Connection, memory_mb: int) -> None:
    if memory_mb > 0:
        cap = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    vocabularies = loads(receive.recv_bytes())
    outlines_core = None if vocabularies is None else import_module("outlines_core")  # after the cap
    send.send_bytes(b"ready")
    while True:
        try:
            request = loads(receive.recv_bytes())
        except EOFError:  # the parent is gone or closed us
            return
        if isinstance(request, ConvertRequest):
            reply, stray_thread = _convert(request), False
        else:
            notify = lambda message: send.send_bytes(dumps(("progress", message)))  # noqa: E731
            reply, stray_thread = _build(outlines_core, vocabularies, request, notify)
        if stray_thread:  # an automaton still building holds a core: this worker ends
            reply = ("last", reply)  # (said first, so the parent does not send it another job)
        send.send_bytes(dumps(reply))
        if stray_thread:
            os._exit(0)


def _convert(request: ConvertRequest) -> tuple[str, object]:
    from spruce.constrained.spec import make_spec

    try:
        spec = make_spec(
            json_schema=request.schema_text, whitespace_pattern=request.whitespace_pattern,
            schema_mode=request.schema_mode,
        )  # fmt: skip
    except ConstraintError as e:
        return "error", str(e)
    except RecursionError:
        return "error", "json_schema is nested too deeply; flatten it or use $defs"
    except MemoryError:
        return "error", "converting the json_schema ran out of the worker's memory cap; simplify it"
    except Exception as e:  # a bug in the converter: reported as such, the worker lives on
        return "crash", f"{type(e).__name__}: {e}"
    return "ok", spec


def _build(outlines_core, vocabularies, request: BuildRequest, notify) -> tuple[tuple[str, object], bool]:
    from spruce.constrained.jump_forward import CharAutomaton

    automaton: list = []

    def build_automaton() -> None:
        try:
            automaton.append(CharAutomaton(request.automaton_regex))
        except Exception:  # a regex interegular cannot handle (or out of memory): no jump-forward
            automaton.append(None)

    thread = threading.Thread(target=build_automaton, daemon=True)
    thread.start()  # pure Python, while the index builds below release the GIL
    try:
        sent, index_bytes = _index(outlines_core, vocabularies, request, notify)
        thread.join(request.automaton_grace_s)
        if thread.is_alive():  # the index serves now; jump-forward follows in the answer
            notify(("index_ready", BuildResult(sent, None, index_bytes, 0)))
            sent = None
    except MemoryError:
        return ("error", "the grammar build ran out of its memory cap; simplify the constraint"), True
    except Exception as e:  # outlines-core raises ValueError with the regex engine's message
        return ("error", f"cannot compile constraint: {e}"), thread.is_alive()
    thread.join(request.automaton_wait_s)
    char_automaton = automaton[0] if automaton else None
    automaton_bytes = len(dumps(char_automaton))
    return ("ok", BuildResult(sent, char_automaton, index_bytes, automaton_bytes)), thread.is_alive()


def _index(outlines_core, vocabularies, request: BuildRequest, notify) -> tuple[object | None, int]:
    """(the index to send or None, its size in bytes): see the module docstring."""
    vocabulary, sample, scale = vocabularies
    start = time.monotonic()
    sampled = outlines_core.Index(request.regex, sample)
    estimate = _binary_size(sampled) * scale
    estimate_s = (time.monotonic() - start) * scale
    direct = request.max_transfer_bytes < estimate <= request.max_direct_bytes
    if direct and estimate_s <= request.max_rebuild_s:
        notify(("index_estimated", int(estimate)))
        return None, int(estimate)
    if scale == 1:  # a small vocabulary is its own sample: that was the full build
        index, build_s = sampled, estimate_s
    else:
        start = time.monotonic()
        index = outlines_core.Index(request.regex, vocabulary)
        build_s = time.monotonic() - start
    index_bytes = _binary_size(index)
    if index_bytes <= request.max_transfer_bytes or build_s > request.max_rebuild_s:
        return index, index_bytes
    notify(("index_built", index_bytes))  # feasible: the parent builds its own beside the automaton's
    return None, index_bytes


def _binary_size(index: object) -> int:
    return len(index.__reduce__()[1][0])


def _watch_parent(parent_pid: int) -> None:
    """Ends this worker when its parent is gone (a build can run long after)."""

    def check() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=check, daemon=True).start()


def main(argv: list[str]) -> None:
    """The worker's entry point: `python -m spruce.constrained.build_worker READ_FD WRITE_FD MEMORY_MB`."""
    _watch_parent(os.getppid())
    read_fd, write_fd, memory = (int(a) for a in argv[:3])
    _serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False), memory)


if __name__ == "__main__":
    # Run as the package module, not as __main__, so pickled classes name their real module.
    from spruce.constrained import build_worker

    build_worker.main(sys.argv[1:])
