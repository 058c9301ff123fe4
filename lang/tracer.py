"""Tracing: a program's IR without a backend, and the first prompt text of a run.

`TraceExecutor` stands in for the interpreter's Executor: it records the nodes a program
appends instead of running them. Reading a variable gives a `Var` placeholder, unbound
arguments are `Arg` placeholders, and a fork records each child's nodes in its `Fork` node.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from spruce.lang.backend import Backend
from spruce.lang.errors import ProgramError
from spruce.lang.ir import Arg, Fork, Join, Node, Var, flatten
from spruce.runtime.protocol.dsl import GenerateMsg


class TraceExecutor:
    def __init__(self) -> None:
        self._entries: list[Node | list[TraceExecutor]] = []  # a list: a fork's children
        self.variables: dict[str, Any] = {}

    def submit(self, node: Node) -> None:
        self._entries.extend(flatten(node))

    def nodes(self) -> tuple[Node, ...]:
        """The recorded IR, forks filled in with their children's nodes."""
        out = []
        for entry in self._entries:
            if isinstance(entry, list):
                out.append(Fork(len(entry), tuple(child.nodes() for child in entry)))
            else:
                out.append(entry)
        return tuple(out)

    def fork(self, size: int) -> list[TraceExecutor]:
        children = [TraceExecutor() for _ in range(size)]
        self._entries.append(children)
        return children

    def join(self, children: list[TraceExecutor], mode: str) -> None:
        self._entries.append(Join(mode))

    def get_var(self, name: str) -> Any:
        return self.variables.get(name, Var(name))

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str) -> Any:
        return None

    def sync(self) -> None:
        pass

    def error(self) -> BaseException | None:
        return None

    def text(self) -> str:
        raise ProgramError("a traced program has no text: it never ran (use prog.run)")

    def messages(self) -> list[dict[str, str]]:
        raise ProgramError("a traced program has no messages: it never ran (use prog.run)")

    def iter_text(self, var_name: str | None = None):
        raise ProgramError("a traced program streams nothing: it never ran (use prog.run)")


def trace_program(func: Callable, args: tuple, kwargs: dict[str, Any]) -> list[Node]:
    from spruce.lang.state import ProgramState

    executor = TraceExecutor()
    state = ProgramState(executor)
    func(state, *args, **_with_placeholders(func, args, kwargs))
    return list(executor.nodes())


def _with_placeholders(func: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs plus an Arg placeholder for every parameter given neither way."""
    params = list(inspect.signature(func).parameters.values())[1 + len(args) :]
    out = dict(kwargs)
    for p in params:
        named = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if named and p.name not in out and p.default is inspect.Parameter.empty:
            out[p.name] = Arg(p.name)
    return out


# -- the first prompt of a run (run_batch's prefix hint) ----------------------------------------


class _FirstRequest(BaseException):
    """Raised by the probe backend at a program's first request; carries its text. A
    BaseException so that a program's own `except Exception` does not swallow it."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class _ProbeBackend(Backend):
    """Renders roles with the real backend's template but stops at the first request."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def model_info(self) -> dict[str, Any]:
        return self._backend.model_info()

    def generate(self, msg: GenerateMsg):
        raise _FirstRequest(msg.text if isinstance(msg.text, str) else "")

    generate_stream = generate


def first_prompt_text(
    func: Callable, backend: Backend, args: tuple, kwargs: dict[str, Any]
) -> str | None:
    """The text of the first request the program would send (its Python runs up to that
    point), or None if it sends none or fails before."""
    from spruce.lang.interpreter import Executor, RunDefaults
    from spruce.lang.state import ProgramState

    executor = Executor(_ProbeBackend(backend), RunDefaults())
    try:
        func(ProgramState(executor), *args, **kwargs)
    except _FirstRequest:
        pass
    except Exception:  # noqa: BLE001 - the real run reports the program's own errors
        return None
    finally:
        executor.end()
    error = executor.error_
    return error.text if isinstance(error, _FirstRequest) else None
