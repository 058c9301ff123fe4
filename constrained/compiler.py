"""Compiles constraint specs into shared CompiledGrammars: builds run in worker processes
(build_worker.py) under a deadline and a memory cap, results are cached by spec in an LRU
bounded in bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import NamedTuple

from spruce.constrained import backends
from spruce.constrained.automaton.grammar import CompiledGrammar
from spruce.constrained.automaton.vocab import TokenVocabulary
from spruce.constrained.build_worker import BuildRequest, ConvertRequest, WorkerPool
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


class _Start:
    """When a build left the queue: its deadline counts from there."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None  # None while queued

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()


class _InFlight(NamedTuple):
    started: _Start
    ready: Future  # the grammar, once built and cached (or the build's error)
    build: Future  # CompiledGrammar


class GrammarCompiler:
    """One per model. `compile` blocks; `submit` never does: it returns a Future resolved
    by a build thread (ConstraintError on failure, or `timeout_s` after its build started:
    waiting behind other builds does not count). A spec being
    compiled is compiled once, whoever asks. Thread-safe.

    Each build runs in a worker process (build_worker.py) capped at `memory_mb` of address
    space; at `timeout_s` the worker is killed, so a pathological constraint fails its own
    requests and costs nothing after. The worker sends back the regex's byte-level NFA;
    the grammar determinizes it lazily here, and the build ends by computing the initial
    state's token mask (the first step of every request). The
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
    ) -> None:
        self.vocab = TokenVocabulary(tokenizer, vocab_size)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.grammar_bytes = grammar_bytes or max(
            int(GRAMMAR_SHARE_OF_CACHE * cache_bytes), MIN_GRAMMAR_BYTES
        )
        self.live = SharedBudget(max(LIVE_SHARE_OF_CACHE * cache_bytes, self.grammar_bytes))
        self.timeout_s = timeout_s
        self._cache: OrderedDict[ConstraintSpec, CompiledGrammar] = OrderedDict()
        self._builds: dict[ConstraintSpec, _InFlight] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="spruce-grammar")
        self._workers = WorkerPool(memory_mb, NUM_WORKERS)
        self._deadlines = _Deadlines()

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
            entry, fresh = self._builds.get(spec), False
            if entry is None:
                started, ready = _Start(), Future()
                build = self._executor.submit(self._build, spec, started)
                entry = self._builds[spec] = _InFlight(started, ready, build)
                fresh = True
        if fresh:  # outside the lock: a build that already failed runs _finish right here
            entry.build.add_done_callback(lambda done: self._finish(spec, done, entry.ready))
        self._deadlines.watch(result, entry.started, spec, self.timeout_s)
        entry.ready.add_done_callback(lambda done: _resolve(result, *_outcome(done)))
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
        self._workers.close()
        self._deadlines.close()

    def _build(self, spec: ConstraintSpec, started: _Start) -> CompiledGrammar:
        """Compiles the spec; a schema llguidance refuses now goes to the spruce converter
        where auto left that decision to the compile (`ConstraintSpec.fallback`)."""
        started.set()
        try:
            grammar = self._compile(spec)
        except GrammarRefused:
            if spec.fallback is None:
                raise
            grammar = self._compile(self._fallback(spec))
        grammar.warm()  # the first mask, off the scheduler thread
        return grammar

    def _compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The spruce automaton's NFA is built in a worker process; the other backends
        compile here, on this build thread (llguidance drops the GIL and bounds its work with
        its own limits, backends/llguidance_text.py)."""
        if spec.backend == "spruce":
            nfa = self._workers.run(BuildRequest(spec.regex), self.timeout_s)
            return CompiledGrammar(spec, nfa, self.vocab, self.grammar_bytes, self.live)
        return backends.module(spec.backend).compile_grammar(
            spec, self.vocab, self.grammar_bytes, self.live
        )

    def _fallback(self, spec: ConstraintSpec) -> ConstraintSpec:
        """The spruce converter's spec of the schema (in a worker, as the front door converts)."""
        options = spec.fallback or {}
        request = ConvertRequest(
            JSON_SCHEMA, spec.value, options.get("whitespace_pattern", ""), LENIENT, "spruce",
            schema_options=options,
        )  # fmt: skip
        return self._workers.run(request, self.timeout_s)

    def _finish(self, spec: ConstraintSpec, build: Future, ready: Future) -> None:
        """Caches the finished grammar and resolves `ready`."""
        error = build.exception()
        if error is None:
            grammar = build.result()
            with self._lock:
                self._store(spec, grammar)
                self._builds.pop(spec, None)
            _resolve(ready, value=grammar)
        else:
            with self._lock:
                self._builds.pop(spec, None)
            if not isinstance(error, ConstraintError):
                error = ConstraintError(f"cannot compile constraint: {error!r}")
            _resolve(ready, error=error)

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
    """Fails each watched future `timeout_s` after its build started: time spent queued
    behind other builds does not count against a request (only its own build's cost does).
    One thread for all of them, started with the first."""

    POLL_S = 1.0  # how often builds still queued are looked at

    def __init__(self) -> None:
        self._watched: list[tuple[Future, _Start, ConstraintSpec, float]] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(
        self, result: Future, started: _Start, spec: ConstraintSpec, timeout_s: float
    ) -> None:
        item = (result, started, spec, timeout_s)
        with self._wake:
            self._watched.append(item)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="spruce-grammar-deadline"
                )
                self._thread.start()
            elif timeout_s < self.POLL_S:  # else its next look comes first: no wake-up
                self._wake.notify()
        # resolved, it leaves the watch at once: the future holds the grammar
        result.add_done_callback(lambda _: self._forget(item))

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
            for result, spec, timeout_s in due:  # outside the lock: failing runs callbacks
                _expire(result, spec, timeout_s)

    def _take_due(self) -> tuple[list[tuple[Future, ConstraintSpec, float]], float]:
        """(what is due now, leaving the watch; the seconds until the next look)."""
        now, wait, kept, due = time.monotonic(), self.POLL_S, [], []
        for item in self._watched:
            result, started, spec, timeout_s = item
            if result.done():
                continue
            if started.at is not None and now >= started.at + timeout_s:
                due.append((result, spec, timeout_s))
                continue
            kept.append(item)
            if started.at is not None:
                wait = min(wait, started.at + timeout_s - now)
        self._watched = kept
        return due, max(wait, 0.001)


def _expire(result: Future, spec: ConstraintSpec, timeout_s: float) -> None:
    message = f"constraint not compiled within {timeout_s:g} s: {spec.value[:80]!r}"
    _resolve(result, error=ConstraintError(message))


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
