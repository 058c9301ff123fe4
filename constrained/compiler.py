"""Compiles constraint specs into shared CompiledGrammars: builds run in worker processes
(build_worker.py) under a deadline and a memory cap, results are cached by spec in an LRU
bounded in bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor

from spruce.constrained import backends
from spruce.constrained.automaton.grammar import CompiledGrammar
from spruce.constrained.automaton.vocab import TokenVocabulary
from spruce.constrained.build_worker import BuildRequest, ConvertRequest, GrammarCheck, WorkerPool
from spruce.constrained.core.errors import ConstraintError, GrammarRefused
from spruce.constrained.core.memory import SharedBudget
from spruce.constrained.schema.schema_context import LENIENT
from spruce.constrained.spec import JSON_SCHEMA, ConstraintSpec

NUM_WORKERS = 2  # a slow build does not hold up every other constraint
# One grammar may hold this share of the cache's bytes (its NFA, and the DFA rows and masks
# its requests add), and at least MIN_GRAMMAR_BYTES: a request whose walk would grow it
# further is aborted (GrammarTooLarge), the others go on.
GRAMMAR_SHARE_OF_CACHE = 0.25
MIN_GRAMMAR_BYTES = 32 * 2**20
# Every live grammar together (cached, or evicted but still held by running requests) may
# hold this many times the cache's bytes; past it, the walk that would grow one is refused.
LIVE_SHARE_OF_CACHE = 2


class _Job:
    """One build in flight: its deadline (`due`, on the compiler's clock: the first request's
    submission plus the timeout, so its wait in the queue counts), the event that stops its
    worker (`stop`) and the future of its grammar (`ready`)."""

    __slots__ = ("due", "stop", "ready")

    def __init__(self, due: float) -> None:
        self.due = due
        self.stop = threading.Event()
        self.ready: Future = Future()


class GrammarCompiler:
    """One per model. `compile` blocks; `submit` never does: it returns a Future resolved
    by a build thread (ConstraintError on failure, or `timeout_s` after the build was first
    asked for: its wait behind other builds counts). A spec being compiled is compiled once,
    whoever asks. Thread-safe. `clock` (time.monotonic) is what deadlines are read on.

    Builds run where the deadline can stop them: the spruce automaton's NFA is built in a
    worker process (build_worker.py) capped at `memory_mb` of address space, and an
    llguidance grammar is compiled for the vocabulary with its first mask in one
    (GrammarCheck) before it is compiled here; at the deadline the worker is killed, so a
    pathological constraint fails its own requests and costs nothing after, and a build
    still queued at its deadline never starts. The worker sends back the regex's byte-level
    NFA; the grammar determinizes it lazily here, and the build ends by computing the
    initial state's token mask (the first step of every request). The
    cache keeps the most recently used grammars within `cache_bytes` and `cache_size`
    entries, counting what each grammar holds now (`CompiledGrammar.nbytes`: it grows as
    requests walk it; the bound is enforced whenever a grammar is asked for or stored). A
    grammar that passed its own budget (`grammar_bytes`) is dropped from the cache; the
    requests holding it keep it until they end. All live grammars together are held to
    `live.max_bytes` (LIVE_SHARE_OF_CACHE times the cache), so grammars evicted while
    requests still walk them are bounded too. Workers start on the first build (about
    0.4 s) and are replaced after a number of builds (build_worker.py)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int | None = None,
        cache_size: int = 64,
        timeout_s: float = 30,
        cache_bytes: int = 1 << 30,
        memory_mb: int = 4096,
        grammar_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.vocab = TokenVocabulary(tokenizer, vocab_size)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.grammar_bytes = grammar_bytes or max(
            int(GRAMMAR_SHARE_OF_CACHE * cache_bytes), MIN_GRAMMAR_BYTES
        )
        self.live = SharedBudget(max(LIVE_SHARE_OF_CACHE * cache_bytes, self.grammar_bytes))
        self.timeout_s = timeout_s
        self.clock = clock
        self._cache: OrderedDict[ConstraintSpec, CompiledGrammar] = OrderedDict()
        self._builds: dict[ConstraintSpec, _Job] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="spruce-grammar")
        self._workers = WorkerPool(memory_mb, NUM_WORKERS)
        self._deadlines = _Deadlines(clock)

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def cached_bytes(self) -> int:
        """Memory the cached grammars hold now (see CompiledGrammar.nbytes)."""
        with self._lock:
            return self._total_bytes()

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        return self.submit(spec).result()

    def submit(self, spec: ConstraintSpec) -> Future:
        """Future[CompiledGrammar]; already resolved on a cache hit."""
        result: Future = Future()
        with self._lock:
            self._evict()
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                result.set_result(grammar)
                return result
            job, build = self._builds.get(spec), None
            if job is None:
                job = self._builds[spec] = _Job(self.clock() + self.timeout_s)
                build = self._executor.submit(self._build, spec, job)
        if build is not None:  # outside the lock: a build that already failed runs _finish here
            build.add_done_callback(lambda done: self._finish(spec, done, job))
            self._deadlines.watch(job, lambda: self._expire(spec, job))
        job.ready.add_done_callback(lambda done: _resolve(result, *_outcome(done)))
        return result

    def cached(self, spec: ConstraintSpec) -> CompiledGrammar | None:
        with self._lock:
            return self._cache.get(spec)

    def clear(self) -> None:
        """Drops every cached grammar (requests that hold one keep it until they end)."""
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for job in self._builds.values():
                job.stop.set()
        self._workers.close()
        self._deadlines.close()

    def _build(self, spec: ConstraintSpec, job: _Job) -> CompiledGrammar:
        """Compiles the spec; a schema llguidance refuses now goes to the spruce converter
        where auto left that decision to the compile (`ConstraintSpec.fallback`)."""
        self._in_time(job, repr(spec.value[:80]))
        try:
            grammar = self._compile(spec, job)
        except GrammarRefused:
            if spec.fallback is None:
                raise
            grammar = self._compile(self._fallback(spec, job), job)
        grammar.warm()  # the first mask, off the scheduler thread
        return grammar

    def _compile(self, spec: ConstraintSpec, job: _Job) -> CompiledGrammar:
        """The spruce automaton's NFA is built in a worker process, an llguidance grammar
        checked in one (_llguidance); the outlines backend compiles here, on this build
        thread."""
        if spec.backend == "spruce":
            nfa = self._run(BuildRequest(spec.regex), job)
            return CompiledGrammar(spec, nfa, self.vocab, self.grammar_bytes, self.live)
        if spec.backend == "llguidance":
            return self._llguidance(spec, job)
        return backends.module(spec.backend).compile_grammar(
            spec, self.vocab, self.grammar_bytes, self.live
        )

    def _llguidance(self, spec: ConstraintSpec, job: _Job) -> CompiledGrammar:
        """An llguidance grammar is compiled for the vocabulary, with its first mask, in a
        worker under the deadline and memory cap (what can take long or grow large), then
        here: a grammar that passed costs as much again, bounded by what the worker saw."""
        llguidance = backends.module("llguidance")
        spec = llguidance.prepared(spec, self.vocab)
        table = llguidance.vocab_table(self.vocab)
        self._run(GrammarCheck(spec.grammar, spec.kind, table.key, table), job)
        return llguidance.LLGuidanceGrammar(spec, self.vocab, self.grammar_bytes, self.live)

    def _fallback(self, spec: ConstraintSpec, job: _Job) -> ConstraintSpec:
        """The spruce converter's spec of the schema (in a worker, as the front door converts)."""
        options = spec.fallback or {}
        request = ConvertRequest(
            JSON_SCHEMA, spec.value, options.get("whitespace_pattern", ""), LENIENT, "spruce",
            schema_options=options,
        )  # fmt: skip
        return self._run(request, job)

    def _run(self, request: BuildRequest | ConvertRequest | GrammarCheck, job: _Job) -> object:
        """The request's answer from a worker, stopped at the job's deadline (a job whose
        deadline passed while it waited in the queue never starts one)."""
        self._in_time(job, request.describe)
        return self._workers.run(request, self.timeout_s, job.stop)

    def _in_time(self, job: _Job, what: str) -> None:
        if job.stop.is_set() or self.clock() >= job.due:
            raise _overdue(what, self.timeout_s)

    def _finish(self, spec: ConstraintSpec, build: Future, job: _Job) -> None:
        """Caches the finished grammar and resolves `job.ready` (unless its deadline did)."""
        error = build.exception()
        with self._lock:
            if self._builds.get(spec) is job:
                del self._builds[spec]
            if error is None:
                self._store(spec, build.result())
        if error is None:
            _resolve(job.ready, value=build.result())
            return
        if not isinstance(error, ConstraintError):
            error = ConstraintError(f"cannot compile constraint: {error!r}")
        _resolve(job.ready, error=error)

    def _expire(self, spec: ConstraintSpec, job: _Job) -> None:
        """At the job's deadline: its requests fail, its worker is stopped, and the spec is
        free to be built afresh when asked again."""
        with self._lock:
            if self._builds.get(spec) is job:
                del self._builds[spec]
        job.stop.set()
        _resolve(job.ready, error=_overdue(repr(spec.value[:80]), self.timeout_s))

    def _store(self, spec: ConstraintSpec, grammar: CompiledGrammar) -> None:
        """Caches a grammar within the bounds (one larger than the whole byte budget is
        used, but not kept)."""
        if spec not in self._cache:
            self._cache[spec] = grammar
            self._evict()

    def _evict(self) -> None:
        """Drops exhausted grammars, then least recently used ones beyond the bounds."""
        for spec in [s for s, g in self._cache.items() if g.exhausted]:
            del self._cache[spec]
        total = self._total_bytes()
        while self._cache and (len(self._cache) > self.cache_size or total > self.cache_bytes):
            _, evicted = self._cache.popitem(last=False)
            total -= evicted.nbytes

    def _total_bytes(self) -> int:
        return sum(grammar.nbytes for grammar in self._cache.values())


class _Deadlines:
    """Calls each watched job's `expire` once the clock reaches its `due` (unless its
    grammar is ready first). One thread for all of them, started with the first; it looks
    at least every POLL_S, so a clock that jumps (a test's) is seen within that."""

    POLL_S = 1.0

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._watched: list[tuple[_Job, Callable[[], None]]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, job: _Job, expire: Callable[[], None]) -> None:
        item = (job, expire)
        with self._wake:
            self._watched.append(item)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="spruce-grammar-deadline"
                )
                self._thread.start()
            else:
                self._wake.notify()
        # resolved, it leaves the watch at once: the future holds the grammar
        job.ready.add_done_callback(lambda _: self._forget(item))

    def _forget(self, item: tuple) -> None:
        with self._wake:
            if item in self._watched:
                self._watched.remove(item)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                if self._closed:
                    return
                due, wait = self._take_due()
                if not due:
                    self._wake.wait(wait)
            for expire in due:  # outside the lock: failing runs callbacks
                expire()

    def _take_due(self) -> tuple[list[Callable[[], None]], float]:
        """(the expiries due now, leaving the watch; the seconds until the next look)."""
        now, wait, kept, due = self.clock(), self.POLL_S, [], []
        for item in self._watched:
            job, expire = item
            if job.ready.done():
                continue
            if now >= job.due:
                due.append(expire)
                continue
            kept.append(item)
            wait = min(wait, job.due - now)
        self._watched = kept
        return due, max(wait, 0.001)


def _overdue(what: str, timeout_s: float) -> ConstraintError:
    return ConstraintError(
        f"constraint not compiled within {timeout_s:g} s (the work was stopped): {what}"
    )


def _outcome(done: Future) -> tuple[object, BaseException | None]:
    """(value, error) of a finished future, as _resolve takes them."""
    error = done.exception()
    return (None, error) if error is not None else (done.result(), None)


def _resolve(result: Future, value: object = None, error: BaseException | None = None) -> None:
    try:  # whichever of the build and the deadline comes second finds the future done
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)
    except InvalidStateError:
        pass
