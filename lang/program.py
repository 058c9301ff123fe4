"""Programs: `@sl.function` wraps `def prog(s, ...)`; run, run_batch, trace.

@sl.function
def qa(s, question):
    s += "Q: " + question + "\\nA:" + sl.gen("answer", max_tokens=16, stop="\\n")

state = qa.run(question="...", temperature=0)      # sampling defaults for every gen
states = qa.run_batch([{"question": q} for q in questions], progress_bar=True)
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spruce.lang.backend import Backend
from spruce.lang.errors import ProgramError, RuntimeRequestError
from spruce.lang.interpreter import Executor, RunDefaults
from spruce.lang.ir import DSL_NAMES, REQUEST_OPTIONS, SAMPLING_FIELDS, Node, split_params
from spruce.lang.state import ProgramState
from spruce.lang.tracer import first_prompt_text, trace_program

MIN_PREFIX_HINT_CHARS = 16  # shorter common prefixes are not worth a request

_default_backend: Backend | None = None  # set_default_backend(); one per process, like SGLang


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when `run` gets none: a RuntimeEndpoint or a Runtime."""
    global _default_backend
    _default_backend = _as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


def resolve_backend(backend: Any = None) -> Backend:
    if backend is not None:
        return _as_backend(backend)
    if _default_backend is None:
        raise ProgramError(
            "no backend: pass backend=sl.RuntimeEndpoint('tcp://127.0.0.1:30001') (or sl.Runtime()) "
            "to run, or call sl.set_default_backend(...) first"
        )
    return _default_backend


def _as_backend(backend: Any) -> Backend:
    backend = getattr(backend, "endpoint", backend)  # a Runtime stands for its endpoint
    if not isinstance(backend, Backend):
        raise ProgramError(
            f"a backend must be a RuntimeEndpoint or a Runtime; got {type(backend).__name__}"
        )
    return backend


class Program:
    """A DSL program (what `@sl.function` returns)."""

    def __init__(
        self,
        func: Callable,
        bound: dict[str, Any] | None = None,
        num_api_spec_tokens: int | None = None,
    ) -> None:
        self.func = func
        self.bound = dict(bound or {})
        # SGLang's speculative execution for API models (OpenAI...): a Spruce runtime serves
        # the model itself, so every gen is one request and this is kept but not used.
        self.num_api_spec_tokens = num_api_spec_tokens
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise ProgramError(
                f"{func.__name__} must take the program state as its first parameter (def prog(s, ...))"
            )
        self.arg_names = {
            p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        self.positional = [
            p for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in params[1:])
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        return Program(self.func, {**self.bound, **kwargs}, self.num_api_spec_tokens)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,
        **kwargs: Any,
    ) -> ProgramState:
        """Runs the program; returns its state. Keywords that are not the program's own
        arguments are sampling defaults for every gen (max_new_tokens / max_tokens,
        temperature, stop, ..., return_logprob): a gen's own non-None fields win.

        stream=True returns at once while the program runs: read `state.text_iter()`.
        use_thread=False runs each expression in the program's own thread as it is
        appended (no worker thread per state; forks then run one after the other).
        An error inside the DSL (a refused request...) is kept in `state.error()`; an
        exception raised by the program's own Python propagates (when not streaming)."""
        program_kwargs, defaults = self._split(kwargs)
        kwargs = {**self.bound, **program_kwargs}
        return run_program(
            self.func,
            resolve_backend(backend),
            args,
            kwargs,
            defaults,
            stream,
            use_thread=use_thread,
        )

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[tuple],
        *,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        backend: Any = None,
        **kwargs: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs one program per item on a thread pool; returns the states in order. An item
        is a dict of arguments or a tuple / list of positional ones. The batch's common
        prompt prefix is sent first (a zero-output request) so that every program finds it
        cached. A program that fails does not stop the others: its state holds the error
        (`state.error()`, `state.ok`). generator_style=True returns an iterator that yields
        each state, in order, as soon as it is done."""
        backend = resolve_backend(backend)
        common, defaults = self._split(kwargs)
        batch = [{**self.bound, **common, **self._arguments(item)} for item in batch_kwargs]
        workers = _thread_count(num_threads, max(len(batch), 1))
        states = self._batch_states(backend, batch, defaults, workers, progress_bar)
        return states if generator_style else list(states)

    def _batch_states(
        self,
        backend: Backend,
        batch: list[dict],
        defaults: RunDefaults,
        workers: int,
        progress_bar: bool,
    ) -> Iterator[ProgramState]:
        if not batch:
            return
        send_prefix_hint(self.func, backend, batch)
        bar = _progress(len(batch), progress_bar)
        with ThreadPoolExecutor(workers, thread_name_prefix="spruce-batch") as pool:
            futures = [
                pool.submit(run_program, self.func, backend, (), kw, defaults, False, False)
                for kw in batch
            ]
            if bar is not None:
                for future in futures:
                    future.add_done_callback(lambda _: bar.update())
            for future in futures:
                yield future.result()
        if bar is not None:
            bar.close()

    def _arguments(self, item: Any) -> dict[str, Any]:
        """A batch item as keyword arguments (a tuple / list fills the parameters in order)."""
        if isinstance(item, dict):
            return dict(item)
        if not isinstance(item, (list, tuple)):
            raise ProgramError(
                f"a run_batch item is a dict or a tuple of arguments; got {type(item).__name__}"
            )
        required = sum(1 for p in self.positional if p.default is p.empty)
        if not required <= len(item) <= len(self.positional):
            names = ", ".join(p.name for p in self.positional)
            raise ProgramError(
                f"a run_batch item of {len(item)} values does not fit {self.__name__}(s, {names}): "
                f"give {required} to {len(self.positional)} values, or a dict"
            )
        return {p.name: value for p, value in zip(self.positional, item)}

    def trace(self, *args: Any, backend: Any = None, **kwargs: Any) -> list[Node]:
        """The program's IR: the typed, immutable nodes it appends, with no backend.
        Arguments not given are `Arg` placeholders; variables read are `Var` placeholders."""
        program_kwargs, _ = self._split(kwargs)
        return trace_program(self.func, args, {**self.bound, **program_kwargs})

    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], RunDefaults]:
        """(the program's own keyword arguments, the sampling defaults)."""
        program, dsl = {}, {}
        for key, value in kwargs.items():
            if key in self.arg_names or (self.takes_any_keyword and not _is_dsl_keyword(key)):
                program[key] = value
            else:
                dsl[key] = value
        sampling, options = split_params(dsl, f"{self.__name__}.run")
        return program, RunDefaults(tuple(sampling.items()), tuple(options.items()))

    def __repr__(self) -> str:
        return f"<spruce program {self.__name__}>"


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """`@sl.function` (or `@sl.function()`): makes `def prog(s, ...)` a Program.

    num_api_spec_tokens: accepted for SGLang programs; a no-op here (SGLang uses it to
    batch the gens of a program for API models, which a Spruce runtime is not)."""
    if func is None:
        return lambda f: Program(f, num_api_spec_tokens=num_api_spec_tokens)
    return Program(func, num_api_spec_tokens=num_api_spec_tokens)


def run_program(
    func: Callable,
    backend: Backend,
    args: tuple,
    kwargs: dict[str, Any],
    defaults: RunDefaults,
    stream: bool,
    reraise: bool = True,
    use_thread: bool = True,
) -> ProgramState:
    state = ProgramState(Executor(backend, defaults, stream, use_thread))
    if stream:
        thread = threading.Thread(
            target=_body, args=(func, state, args, kwargs, False), daemon=True
        )
        thread.start()
        state._executor.program_thread = thread.ident
    else:
        _body(func, state, args, kwargs, reraise)
    return state


def _body(
    func: Callable, state: ProgramState, args: tuple, kwargs: dict[str, Any], reraise: bool
) -> None:
    executor = state._executor
    try:
        state.ret_value = func(state, *args, **kwargs)
    except BaseException as e:
        if executor.error_ is None:
            executor.error_ = e  # also stops what the program had queued
        if reraise:
            raise
    finally:
        executor.end()


def send_prefix_hint(func: Callable, backend: Backend, batch: list[dict[str, Any]]) -> str:
    """Commits the longest common prefix of the programs' first prompt texts (cut before
    its last whitespace, near a token boundary); returns it ("" when none was sent)."""
    if len(batch) < 2:
        return ""
    texts = [first_prompt_text(func, backend, (), kw) for kw in batch]
    texts = [t for t in texts if t]
    if len(texts) < 2:
        return ""
    prefix = os.path.commonprefix(texts)  # noqa: RUF071 - a text prefix, by character
    cut = max(prefix.rfind(" "), prefix.rfind("\n"))
    prefix = prefix[:cut] if cut > 0 and len(prefix) < min(len(t) for t in texts) else prefix
    if len(prefix) < MIN_PREFIX_HINT_CHARS:
        return ""
    try:
        backend.commit(prefix)
    except RuntimeRequestError:  # only a hint: the programs report their own errors
        return ""
    return prefix


def _is_dsl_keyword(key: str) -> bool:
    return DSL_NAMES.get(key, key) in SAMPLING_FIELDS or key in REQUEST_OPTIONS


def _thread_count(num_threads: int | str, batch_size: int) -> int:
    if num_threads == "auto":
        num_threads = max(64, 16 * (os.cpu_count() or 1))
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ProgramError(f"num_threads must be 'auto' or an integer >= 1; got {num_threads!r}")
    return min(num_threads, batch_size)


def _progress(total: int, enabled: bool):
    """A tqdm bar of `total` programs, or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total)
