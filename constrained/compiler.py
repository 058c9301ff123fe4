"""Compiles constraint specs into shared CompiledGrammars, on worker threads, with an LRU
cache keyed by the spec."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import outlines_core

from spruce.constrained.grammar import CompiledGrammar
from spruce.constrained.jump_forward import CharAutomaton
from spruce.constrained.patterns import index_regex
from spruce.constrained.spec import ConstraintSpec
from spruce.constrained.vocab import TokenVocabulary
from spruce.constrained.errors import ConstraintError

NUM_WORKERS = 2  # a slow build (tens of seconds) does not hold up every other constraint


class GrammarCompiler:
    """One per model. `compile` blocks; `submit` never does: it returns a Future resolved
    by a worker thread (ConstraintError on failure or after `timeout_s`). A spec being
    compiled is compiled once, whoever asks. Thread-safe.

    The outlines-core index build releases the GIL; the character automaton (interegular,
    pure Python) does not, so a worker slows the caller's thread while it builds one.
    A build that overruns its timeout keeps running (it cannot be interrupted) and its
    result is still cached."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int | None = None,
        cache_size: int = 64,
        timeout_s: float = 30,
    ) -> None:
        self.vocab = TokenVocabulary(tokenizer, vocab_size)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._cache: OrderedDict[ConstraintSpec, CompiledGrammar] = OrderedDict()
        self._builds: dict[ConstraintSpec, Future] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="spruce-grammar")
        self._automaton_executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="spruce-automaton")

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        return self.submit(spec).result()

    def submit(self, spec: ConstraintSpec) -> Future:
        """Future[CompiledGrammar]; already resolved on a cache hit."""
        result: Future = Future()
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                result.set_result(grammar)
                return result
            build = self._builds.get(spec)
            if build is None:
                build = self._executor.submit(self._build, spec)
                self._builds[spec] = build
        timer = threading.Timer(self.timeout_s, _expire, (result, spec, self.timeout_s))
        timer.daemon = True
        timer.start()
        build.add_done_callback(lambda done: self._finish(spec, done, result, timer))
        return result

    def cached(self, spec: ConstraintSpec) -> CompiledGrammar | None:
        with self._lock:
            return self._cache.get(spec)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._automaton_executor.shutdown(wait=False, cancel_futures=True)

    def _build(self, spec: ConstraintSpec) -> CompiledGrammar:
        regex = spec.regex
        # The character automaton (pure Python) builds on another thread while the index
        # (Rust, GIL released) builds here: a compile takes the longer of the two, not both.
        automaton = self._automaton_executor.submit(_char_automaton, regex)
        try:
            index = outlines_core.Index(index_regex(regex), self.vocab.vocabulary)
        except Exception as e:  # outlines-core raises ValueError with the regex engine's message
            automaton.cancel()
            raise ConstraintError(f"cannot compile constraint: {e}") from None
        try:  # past half the timeout, go without it: no jump-forward for this grammar
            char_automaton = automaton.result(timeout=self.timeout_s / 2)
        except FutureTimeout:
            char_automaton = None
        return CompiledGrammar(spec, regex, index, self.vocab, char_automaton)

    def _finish(
        self, spec: ConstraintSpec, build: Future, result: Future, timer: threading.Timer
    ) -> None:
        timer.cancel()
        error = build.exception()
        if error is None:
            with self._lock:
                self._cache[spec] = build.result()
                self._cache.move_to_end(spec)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                self._builds.pop(spec, None)
            _resolve(result, value=build.result())
        else:
            with self._lock:
                self._builds.pop(spec, None)
            if not isinstance(error, ConstraintError):
                error = ConstraintError(f"cannot compile constraint: {error!r}")
            _resolve(result, error=error)


def _char_automaton(regex: str) -> CharAutomaton | None:
    try:
        return CharAutomaton(regex)
    except Exception:  # a regex interegular cannot handle: jump-forward off for it
        return None


def _expire(result: Future, spec: ConstraintSpec, timeout_s: float) -> None:
    message = f"constraint not compiled within {timeout_s:g} s: {spec.value[:80]!r}"
    _resolve(result, error=ConstraintError(message))


def _resolve(result: Future, value: object = None, error: BaseException | None = None) -> None:
    try:  # whichever of the build and the timer comes second finds the future done
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)
    except InvalidStateError:
        pass
