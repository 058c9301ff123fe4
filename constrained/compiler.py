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
from spruce.constrained.build_worker import BuildRequest, WorkerPool
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


class _Built(NamedTuple):
    grammar: CompiledGrammar
    nbytes: int  # estimated memory (see estimated_bytes)


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
    automaton (for jump-forward) is built in the same worker; if it is not ready
    `timeout_s / 2` after the index, the grammar goes without it. The cache keeps the most
    recently used grammars within `cache_bytes` (estimated, see `estimated_bytes`) and
    `cache_size` entries. Workers start on the first build (about 0.4 s) and are reused."""

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
        self._builds: dict[ConstraintSpec, tuple[Future, threading.Event]] = {}  # build, started
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
            build, started = self._builds.get(spec) or (None, threading.Event())
            if build is None:
                build = self._executor.submit(self._build, spec, started)
                self._builds[spec] = (build, started)
        deadline = threading.Thread(
            target=_watch, args=(result, started, spec, self.timeout_s), daemon=True, name="spruce-grammar-deadline"
        )
        deadline.start()
        build.add_done_callback(lambda done: self._finish(spec, done, result))
        return result

    def cached(self, spec: ConstraintSpec) -> CompiledGrammar | None:
        with self._lock:
            built = self._cache.get(spec)
            return None if built is None else built.grammar

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._rebuilds.shutdown(wait=False, cancel_futures=True)
        self._workers.close()

    def _build(self, spec: ConstraintSpec, started: threading.Event) -> _Built:
        started.set()
        regex = index_regex(spec.regex)
        request = BuildRequest(
            regex, spec.regex, automaton_wait_s=self.timeout_s / 2,
            max_transfer_bytes=MAX_TRANSFER_BYTES, max_rebuild_s=self.timeout_s / 3,
            max_direct_bytes=MAX_DIRECT_BYTES,
        )  # fmt: skip
        rebuilds: list[Future] = []  # the worker says when the index is too large to send

        def rebuild(_=None) -> None:  # off the GIL, while the worker finishes the character automaton
            rebuilds.append(self._rebuilds.submit(outlines_core.Index, regex, self.vocab.vocabulary))

        result = self._workers.run(request, self.timeout_s, on_progress=rebuild)
        index = result.index
        if index is None:  # too large to unpickle without stalling the GIL: built here
            if not rebuilds:
                rebuild()
            index = rebuilds[0].result()
        grammar = CompiledGrammar(spec, spec.regex, index, self.vocab, result.char_automaton)
        nbytes = estimated_bytes(result.index_bytes, result.automaton_bytes, spec)
        return _Built(grammar, nbytes)

    def _finish(self, spec: ConstraintSpec, build: Future, result: Future) -> None:
        error = build.exception()
        if error is None:
            built = build.result()
            with self._lock:
                self._store(spec, built)
                self._builds.pop(spec, None)
            _resolve(result, value=built.grammar)
        else:
            with self._lock:
                self._builds.pop(spec, None)
            if not isinstance(error, ConstraintError):
                error = ConstraintError(f"cannot compile constraint: {error!r}")
            _resolve(result, error=error)

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


def _resolve(result: Future, value: object = None, error: BaseException | None = None) -> None:
    try:  # whichever of the build and the deadline comes second finds the future done
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)
    except InvalidStateError:
        pass
