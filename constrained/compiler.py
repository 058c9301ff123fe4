"""Compiles constraint specs into shared CompiledGrammars: builds run in worker processes
(build_worker.py) under a deadline and a memory cap, results are cached by spec in an LRU
bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import NamedTuple

from spruce.constrained.build_worker import BuildRequest, WorkerPool
from spruce.constrained.errors import ConstraintError
from spruce.constrained.grammar import CompiledGrammar
from spruce.constrained.spec import ConstraintSpec
from spruce.constrained.vocab import TokenVocabulary

NUM_WORKERS = 2  # a slow build does not hold up every other constraint
# A grammar's memory at build time: its NFA (rows of Python ints, measured ~190 bytes per state);
# the lazily made DFA rows (1 KB per state) and token masks (4 bytes per 32 vocabulary ids
# per visited state) come later and are not counted.
NFA_BYTES_PER_STATE = 200


class _Built(NamedTuple):
    grammar: CompiledGrammar
    nbytes: int  # estimated memory (see estimated_bytes)


class _InFlight(NamedTuple):
    started: threading.Event  # the build left the queue (its deadline counts from here)
    ready: Future  # the grammar, once built and cached (or the build's error)
    build: Future  # _Built


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
        self._workers = WorkerPool(memory_mb, NUM_WORKERS)

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def cached_bytes(self) -> int:
        """Estimated memory of the cached grammars."""
        return self._cached_bytes

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        return self.submit(spec).result()

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
                build = self._executor.submit(self._build, spec, started)
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
        self._workers.close()

    def _build(self, spec: ConstraintSpec, started: threading.Event) -> _Built:
        started.set()
        nfa = self._workers.run(BuildRequest(spec.regex), self.timeout_s)
        grammar = CompiledGrammar(spec, nfa, self.vocab)
        grammar.mask(grammar.initial_state)
        return _Built(grammar, estimated_bytes(nfa.num_states, spec))

    def _finish(self, spec: ConstraintSpec, build: Future, ready: Future) -> None:
        """Caches the finished grammar and resolves `ready`."""
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


def estimated_bytes(nfa_states: int, spec: ConstraintSpec) -> int:
    """A compiled grammar's memory when built (see NFA_BYTES_PER_STATE) plus the spec's text."""
    return NFA_BYTES_PER_STATE * nfa_states + len(spec.value) + len(spec.regex)


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
