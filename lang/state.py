"""ProgramState: the `s` a program appends to, and what `run` returns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from spruce.lang.errors import UnsupportedFeatureError
from spruce.lang.ir import Node, RoleBegin, RoleEnd, Seq, VarScopeBegin, VarScopeEnd, to_node


class ProgramState:
    """A program's text, variables and messages. `s += x` appends (a string or a DSL
    expression); `s["name"]` reads a variable, waiting for it to be generated."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self.ret_value: Any = None  # what the program function returned

    # -- appending ----------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        self._executor.submit(to_node(other))
        return self

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any):
        """With an expression: appends the whole block. Without: a context manager,
        `with s.user(): s += ...`."""
        if expr is not None:
            self._executor.submit(Seq((RoleBegin(role), to_node(expr), RoleEnd(role))))
            return None
        return self._scope(RoleBegin(role), RoleEnd(role))

    def var_scope(self, name: str):
        """`with s.var_scope("x"): s += ...` stores the text appended inside as variable x."""
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    @contextmanager
    def _scope(self, begin: Node, end: Node) -> Iterator[None]:
        self._executor.submit(begin)
        yield
        self._executor.submit(end)

    def fork(
        self, size: int = 1, position_ids_offset: list[int] | None = None
    ) -> ProgramStateGroup:
        """`size` copies of this state that run in parallel; the text so far is committed
        to the runtime's cache first, so the children share it. position_ids_offset
        (SGLang's) must be None: children continue at the parent's positions."""
        if position_ids_offset is not None:
            raise UnsupportedFeatureError(
                "fork(position_ids_offset=...): forked states continue at the parent's token positions; "
                "leave it None"
            )
        return ProgramStateGroup([ProgramState(e) for e in self._executor.fork(size)], self)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        """`with s.copy() as c: c += ...`: a fork of one state, joined (gather_variable)
        when the block ends: the variables it set become one-item lists in `s`."""
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # -- reading ------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._executor.settle()
        return name in self._executor.variables

    def get_var(self, name: str) -> Any:
        return self._executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta_info of the gen that set `name` (tokens, cached tokens, finish
        reason, logprobs when asked); for a select, the per-choice scores and logprobs."""
        return self._executor.get_meta_info(name)

    def text(self) -> str:
        return self._executor.text()

    def messages(self) -> list[dict[str, str]]:
        """The closed role blocks: [{"role", "content"}, ...]."""
        return self._executor.messages()

    def sync(self) -> None:
        self._executor.sync()

    def error(self) -> BaseException | None:
        """The error that stopped this program, or None."""
        return self._executor.error()

    @property
    def ok(self) -> bool:
        return self.error() is None

    # -- streaming ----------------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text chunks as they are generated (run with stream=True to get them while the
        program runs): the whole text, or only variable `var_name`'s."""
        return self._executor.iter_text(var_name)

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """text_iter for asyncio. return_meta_data (with var_name): (chunk, meta_info) pairs,
        the meta_info of the variable's latest chunk (its counters so far)."""
        chunks = self.text_iter(var_name)
        loop = asyncio.get_running_loop()
        while True:
            chunk = await loop.run_in_executor(None, next, chunks, None)
            if chunk is None:
                return
            if return_meta_data and var_name is not None:
                yield chunk, self._executor.stream_meta_info(var_name)
            else:
                yield chunk

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states from `s.fork(n)`: index them (`forks[i] += ...`), or append to all at
    once (`forks += "text"`, a list with one item per state, or a function of the index)."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += x` assigns the (same) state back
        if value is not self.states[i]:
            raise TypeError("fork states cannot be replaced; append to them with forks[i] += ...")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        for i, state in enumerate(self.states):
            if isinstance(other, (list, tuple)):
                state += other[i]
            elif isinstance(other, Callable) and not isinstance(other, Node):
                state += other(i)
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Waits for every state. gather_variable: each variable the children set becomes
        a list (one value per child) in the parent; concate_and_append: the children's new
        text is appended to the parent."""
        self.parent._executor.join([s._executor for s in self.states], mode)
