"""Compiles constraint specs into shared CompiledGrammars: builds run in worker processes
(build_worker.py) under a deadline and a memory cap, results are cached by spec in an LRU
bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

import outlines_core
from spruce.constrained.build_worker import BuildRequest, BuildResult, WorkerPool
from spruce.constrained.errors import ConstraintError
from spruce.constrained.grammar import CompiledGrammar
from spruce.constrained.patterns import index_regex
from spruce.constrained.spec import ConstraintSpec
from spruce.constrained.vocab import TokenVocabulary

NUM_WORKERS = 2  # a slow build (tens of seconds) does not hold up every other constraint
# In memory, outlines-core's index (Rust hash maps) takes about this many times its binary
# form (measured 2.3x-3.1x), and the character automaton (Python dicts of ints) this many
# times its pickle (measured 9x-46x: pickle shares the small ints).
INDEX_MEMORY_FACTOR = 3
# Indexes up to this size come back from the worker (unpickling holds the GIL about 12 ms
# per MB); larger ones are built again here, where the build releases the GIL.
MAX_TRANSFER_BYTES = 4 << 20
# An index the worker estimates (from a sample of the vocabulary) up to this size is built
# here at once, without the worker's full build as proof (about 3x this in memory).
MAX_DIRECT_BYTES = 128 << 20
AUTOMATON_MEMORY_FACTOR = 30
# How long a ready index waits for the character automaton before the grammar goes out
# without it: most automata come within it (every small regex); the slow ones (seconds to
# tens of seconds for large schemas) then join the grammar later.
AUTOMATON_GRACE_S = 1.0


class _Built(NamedTuple):
    grammar: CompiledGrammar
    nbytes: int  # estimated memory (see estimated_bytes)


class _InFlight(NamedTuple):
    started: threading.Event  # the build left the queue (its deadline counts from here)
    ready: Future  # the grammar, as soon as its index is ready
    build: Future  # _Built, once the automaton has come (or not)


class GrammarCompiler:
    """One per model. `compile` blocks; `submit` never does: it returns a Future resolved
    by a build thread (ConstraintError on failure, or `timeout_s` after its build started:
    waiting behind other builds does not count). A spec being
    compiled is compiled once, whoever asks. Thread-safe.

    Each build runs in a worker process (build_worker.py) capped at `memory_mb` of address
    space; at `timeout_s` the worker is killed, so a pathological constraint fails its own
    requests and costs nothing after. A small index comes back from the worker; one too
    large to unpickle without a long GIL hold is built here, beside the worker's automaton,
    once the worker has shown it feasible: by its build on a sample of the vocabulary (an
    estimate within MAX_DIRECT_BYTES), else by its own full build. The character
    automaton (for jump-forward) is built in the same worker; when it is not ready within
    AUTOMATON_GRACE_S of the index, `submit` hands the grammar out without jump-forward until
    the automaton joins it (requests that started before keep going without; see
    cursor.py), and `compile` waits for it. If it is not ready `timeout_s / 2` after the
    index (or the worker is stopped at `timeout_s`), the grammar stays without it. The
    cache keeps the most recently used grammars within `cache_bytes` (estimated, see
    `estimated_bytes`) and `cache_size` entries. Workers start on the first build (about 0.4 s) and are reused."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int | None = None,
        cache_size: int = 64,
        timeout_s: float = 30,
        cache_bytes: int = 1 << 30,
        memory_mb: int = 4096,
    ) -> None:
        self.vocab = TokenVocabulary(tokenizer, vocab_size)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.timeout_s = timeout_s
        self._cache: OrderedDict[ConstraintSpec, _Built] = OrderedDict()
        self._cached_bytes = 0
        self._builds: dict[ConstraintSpec, _InFlight] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="spruce-grammar")
        self._workers = WorkerPool((self.vocab.vocabulary, *self.vocab.sample), memory_mb, NUM_WORKERS)
        self._rebuilds = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="spruce-index")

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def cached_bytes(self) -> int:
        """Estimated memory of the cached grammars."""
        return self._cached_bytes

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """The grammar once its build is over (with its automaton, when it came)."""
        grammar = self.submit(spec).result()
        with self._lock:
            entry = self._builds.get(spec)
        if entry is not None:
            futures_wait([entry.build], self.timeout_s)
        return grammar

    def submit(self, spec: ConstraintSpec) -> Future:
        """Future[CompiledGrammar]; already resolved on a cache hit."""
        result: Future = Future()
        with self._lock:
            built = self._cache.get(spec)
            if built is not None:
                self._cache.move_to_end(spec)
                result.set_result(built.grammar)
                return result
            entry, fresh = self._builds.get(spec), False
            if entry is None:
                started, ready = threading.Event(), Future()
                build = self._executor.submit(self._build, spec, started, ready)
                entry = self._builds[spec] = _InFlight(started, ready, build)
                fresh = True
        if fresh:  # outside the lock: a build that already failed runs _finish right here
            entry.build.add_done_callback(lambda done: self._finish(spec, done, entry.ready))
        deadline = threading.Thread(
            target=_watch, args=(result, entry.started, spec, self.timeout_s), daemon=True,
            name="spruce-grammar-deadline",
        )  # fmt: skip
        deadline.start()
        entry.ready.add_done_callback(lambda done: _resolve(result, *_outcome(done)))
        return result

    def cached(self, spec: ConstraintSpec) -> CompiledGrammar | None:
        with self._lock:
            built = self._cache.get(spec)
            return None if built is None else built.grammar

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._rebuilds.shutdown(wait=False, cancel_futures=True)
        self._workers.close()

    def _build(self, spec: ConstraintSpec, started: threading.Event, ready: Future) -> _Built:
        """The grammar with its automaton (or without, see the class); `ready` gets the
        grammar as soon as its index is ready."""
        started.set()
        regex = index_regex(spec.regex)
        request = BuildRequest(
            regex, spec.regex, automaton_wait_s=self.timeout_s / 2, automaton_grace_s=AUTOMATON_GRACE_S,
            max_transfer_bytes=MAX_TRANSFER_BYTES, max_rebuild_s=self.timeout_s / 3,
            max_direct_bytes=MAX_DIRECT_BYTES,
        )  # fmt: skip
        rebuilds: list[Future] = []  # the worker says when the index is too large to send
        early: list[tuple[CompiledGrammar, int]] = []  # handed out before its automaton; index bytes

        def rebuild() -> None:  # off the GIL, while the worker goes on (see build_worker)
            if not rebuilds:
                rebuilds.append(self._rebuilds.submit(outlines_core.Index, regex, self.vocab.vocabulary))

        def index_of(result: BuildResult) -> object:
            if result.index is not None:
                return result.index
            rebuild()  # too large to unpickle without stalling the GIL: built here
            return rebuilds[0].result()

        def progress(message: tuple[str, object]) -> None:
            kind, payload = message
            if kind != "index_ready":  # index_estimated / index_built
                rebuild()
                return
            early.append((CompiledGrammar(spec, spec.regex, index_of(payload), self.vocab, None), payload.index_bytes))
            _resolve(ready, early[0][0])

        try:
            result = self._workers.run(request, self.timeout_s, on_progress=progress)
        except (ConstraintError, RuntimeError):
            if not early:
                raise
            result = BuildResult(None, None, early[0][1], 0)  # the automaton did not come: no jump-forward
        if early:
            grammar = early[0][0]
            grammar.char_automaton = result.char_automaton
        else:
            grammar = CompiledGrammar(spec, spec.regex, index_of(result), self.vocab, result.char_automaton)
        nbytes = estimated_bytes(result.index_bytes, result.automaton_bytes, spec)
        return _Built(grammar, nbytes)

    def _finish(self, spec: ConstraintSpec, build: Future, ready: Future) -> None:
        """Caches the finished grammar and resolves `ready`, unless it was resolved early."""
        error = build.exception()
        if error is None:
            built = build.result()
            with self._lock:
                self._store(spec, built)
                self._builds.pop(spec, None)
            _resolve(ready, value=built.grammar)
        else:
            with self._lock:
                self._builds.pop(spec, None)
            if not isinstance(error, ConstraintError):
                error = ConstraintError(f"cannot compile constraint: {error!r}")
            _resolve(ready, error=error)

    def _store(self, spec: ConstraintSpec, built: _Built) -> None:
        """Caches a grammar, evicting least recently used ones beyond the bounds (one larger
        than the whole byte budget is used, but not kept)."""
        if spec in self._cache:
            return
        self._cache[spec] = built
        self._cached_bytes += built.nbytes
        while self._cache and (len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes):
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.nbytes


def estimated_bytes(index_bytes: int, automaton_bytes: int, spec: ConstraintSpec) -> int:
    """A compiled grammar's memory: the index and the character automaton, from the sizes
    of their serialized forms (factors measured, see the module constants), plus the spec's
    text. The state masks CompiledGrammar computes lazily for visited states are not
    counted (4 bytes per 32 vocabulary ids per visited state)."""
    text = len(spec.value) + len(spec.regex)
    return INDEX_MEMORY_FACTOR * index_bytes + AUTOMATON_MEMORY_FACTOR * automaton_bytes + text


def _watch(result: Future, started: threading.Event, spec: ConstraintSpec, timeout_s: float) -> None:
    """Fails `result` `timeout_s` after its build started: time spent queued behind other
    builds does not count against a request (only its own build's cost does)."""
    while not started.wait(1.0):
        if result.done():
            return
    futures_wait([result], timeout_s)
    if not result.done():
        _expire(result, spec, timeout_s)


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
