"""The interpreter: runs one program state's IR nodes, in order, against a backend.

Each state has an `Executor` with its own worker thread (as in SGLang): `s += node` queues
the node and returns at once, so forked states run in parallel; reading a variable or the
text waits until the queued nodes are done. With use_thread=False a node runs at once, in
the thread that appends it. The first error stops the state: later nodes
are skipped and the error is kept (`state.error()`); reading a variable it did not produce
raises it.

How nodes become requests:
  Gen     the program text so far + the run's defaults overridden by the gen's own fields;
          the runtime's radix cache makes the repeated prefix free. With n > 1: the text
          is committed, then n copies of it go as one batch (the variable is the list).
  Select  see spruce.lang.select (one batched logprob request).
  Fork    commits the parent text (a zero-output request) before the children start.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from spruce.lang.backend import Backend, new_rid
from spruce.lang.chat import Conversation
from spruce.lang.choices import sample_by_scores
from spruce.lang.errors import ProgramError, UnsupportedFeatureError
from spruce.lang.ir import (
    Arg,
    Fork,
    Gen,
    Join,
    Node,
    Params,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    Var,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
)  # fmt: skip
from spruce.lang.select import score_choices
from spruce.runtime.core.sampling_params import SamplingParams
from spruce.runtime.protocol.dsl import FinalMsg, GenerateMsg
from spruce.runtime.text.reasoning import REASONING_FORMATS

_END = object()  # queued last: the worker exits


@dataclass(frozen=True)
class RunDefaults:
    """The sampling fields and request options given to `run` / `run_batch`; a gen's own
    (non-None) fields override them, as in SGLang."""

    sampling: Params = ()
    options: Params = ()

    def request_for(self, node: Gen, text: str | list[str], stream: bool) -> GenerateMsg:
        params = SamplingParams.from_dict({**dict(self.sampling), **node.sampling_params})
        params.validate()
        return GenerateMsg(
            rid=new_rid(),
            text=text,
            sampling_params=_changed_fields(params),
            stream=stream,
            **{**dict(self.options), **node.request_options},
        )


class Executor:
    """use_thread=False runs each node at once, in the thread that appends it (SGLang's
    `run(use_thread=False)`): no parallel forks, but no worker thread either."""

    def __init__(
        self, backend: Backend, defaults: RunDefaults, stream: bool = False, use_thread: bool = True
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.use_thread = use_thread
        self.text_ = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.chat = Conversation()
        self.error_: BaseException | None = None
        self.set_names: list[str] = []  # variables set by this state (for fork / join)
        self.fork_point = 0  # length of the parent's text when this state was forked
        self.fork_commits: list[dict] = []  # meta_info of each fork's prefix commit
        self._partial: dict[str, str] = {}  # variable -> text so far, while streaming
        self._partial_meta: dict[
            str, dict
        ] = {}  # variable -> its latest chunk's meta_info, while streaming
        self._scopes: dict[str, int] = {}
        self._children: list[Executor] = []
        self.program_thread: int | None = None  # the thread running the program, when streaming
        self._rng = random.Random()
        self._queue: queue.Queue = queue.Queue()
        self._changed = threading.Condition()
        self._ended = False
        self._finished = False
        self._handlers: dict[type, Callable[[Any], None]] = {
            Text: lambda n: self._append(n.value),
            Gen: self._gen,
            Select: self._select,
            RoleBegin: lambda n: self._set_text(
                self.chat.begin(self.text_, n.role, self.backend.chat_template)
            ),
            RoleEnd: lambda n: self._set_text(
                self.chat.end(self.text_, n.role, self.backend.chat_template)
            ),
            VarScopeBegin: lambda n: self._scopes.__setitem__(n.name, len(self.text_)),
            VarScopeEnd: self._var_scope_end,
            Fork: self._commit,
            Join: lambda n: None,
            Var: lambda n: self._append(str(self.variables[n.name])),
            Arg: self._unbound_arg,
        }
        self._thread: threading.Thread | None = None
        if use_thread:
            self._thread = threading.Thread(target=self._work, name="spruce-program", daemon=True)
            self._thread.start()

    # -- called by the program (any thread) ------------------------------------------------

    def submit(self, node: Node) -> None:
        if self._ended:
            raise ProgramError("this program state has ended; nothing more can be appended to it")
        for leaf in flatten(node):
            if self._thread is None:
                self._run(leaf)
            else:
                self._queue.put(leaf)

    def sync(self) -> None:
        """Waits until every queued node has run."""
        self._queue.join()

    def settle(self, name: str | None = None) -> None:
        """Waits before a read. In the program's own thread: for the queued nodes. Outside
        a program that streams (run(stream=True) returned at once): for the program's end,
        or only until variable `name` is set."""
        if self.program_thread is None or threading.get_ident() == self.program_thread:
            self.sync()
            return
        with self._changed:
            self._changed.wait_for(
                lambda: self._finished or (name is not None and name in self.variables)
            )

    def end(self) -> None:
        """No more nodes: waits for the queued ones, then stops the worker (and children's)."""
        if not self._ended:
            self._ended = True
            if self._thread is None:
                self._mark_finished()
            else:
                self._queue.put(_END)
        if self._thread is not None:
            self._thread.join()
        for child in self._children:
            child.end()

    def get_var(self, name: str) -> Any:
        self.settle(name)
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        known = ", ".join(sorted(self.variables)) or "none"
        raise KeyError(f"no variable {name!r} in this program state (variables: {known})")

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._set_var(name, value, None)

    def get_meta_info(self, name: str) -> Any:
        self.settle(name)
        return self.meta_info.get(name)

    def stream_meta_info(self, name: str) -> Any:
        """Variable `name`'s meta_info without waiting: its latest chunk's while it streams."""
        with self._changed:
            return self.meta_info.get(name, self._partial_meta.get(name))

    def text(self) -> str:
        self.settle()
        return self.text_

    def messages(self) -> list[dict[str, str]]:
        self.settle()
        return [dict(m) for m in self.chat.messages]

    def error(self) -> BaseException | None:
        self.settle()
        return self.error_

    def fork(self, size: int) -> list[Executor]:
        if not isinstance(size, int) or size < 1:
            raise ProgramError(f"fork needs a size >= 1; got {size!r}")
        self.submit(Fork(size))
        self.sync()
        children = [self._child() for _ in range(size)]
        self._children.extend(children)
        return children

    def join(self, children: list[Executor], mode: str) -> None:
        if mode not in ("gather_variable", "concate_and_append"):
            raise ProgramError(
                f"unknown join mode {mode!r}; known: gather_variable, concate_and_append"
            )
        for child in children:
            child.end()
        self.sync()
        failed = next((c.error_ for c in children if c.error_ is not None), None)
        if failed is not None and self.error_ is None:
            self.error_ = failed
        if mode == "gather_variable":
            for name in dict.fromkeys(n for c in children for n in c.set_names):
                values = [c.variables.get(name) for c in children]
                self._set_var(name, values, [c.meta_info.get(name) for c in children])
        else:
            self.submit(Text("".join(c.text_[c.fork_point :] for c in children)))

    def iter_text(self, var_name: str | None = None) -> Iterator[str]:
        """New text as it is generated, until the program ends: the whole program text, or
        only variable `var_name`'s."""
        sent = 0
        while True:
            with self._changed:
                # B023: wait_for calls the lambda now, with this iteration's `sent`
                self._changed.wait_for(
                    lambda: len(self._watched(var_name)) > sent or self._finished  # noqa: B023
                )
                text, finished = self._watched(var_name), self._finished
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            elif finished:
                return

    # -- the worker --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            node = self._queue.get()
            try:
                if node is _END:
                    break
                self._run(node)
            finally:
                self._queue.task_done()
        self._mark_finished()

    def _run(self, node: Node) -> None:
        try:
            if self.error_ is None:
                self._handlers[type(node)](node)
        except BaseException as e:  # noqa: BLE001 - the error belongs to the state
            self.error_ = e
        finally:
            self._notify()

    def _mark_finished(self) -> None:
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    def _gen(self, node: Gen) -> None:
        if node.n > 1:
            self._gen_samples(node)
            return
        prompt = self.text_
        msg = self.defaults.request_for(node, prompt, self.stream)
        if self.stream:
            final = self._gen_streamed(msg, node.name)
        else:
            final = self.backend.generate(msg)
            self._append(final.text)
        if node.name is not None:
            self._set_gen_var(node, prompt, final.text, final.meta_info)

    def _set_gen_var(self, node: Gen, prompt: str, text: str, meta: Any) -> None:
        if node.reasoning is None:
            self._set_var(node.name, text, meta)
            return
        fmt = REASONING_FORMATS[node.reasoning]
        reasoning, answer = fmt.split(text, fmt.starts_inside(prompt))
        self._set_var(node.name + "_reasoning_content", reasoning, None)
        self._set_var(node.name, answer, meta)

    def _gen_samples(self, node: Gen) -> None:
        """gen(n=k): the text is committed first, then k copies of it go as one batch, so
        every sample finds the prompt in the radix cache."""
        if self.stream:
            raise UnsupportedFeatureError(
                f"gen(n={node.n}) cannot stream; run the program without stream=True"
            )
        if node.reasoning is not None:
            raise UnsupportedFeatureError(
                f"gen(n={node.n}) with separate_reasoning: draw the samples one by one"
            )
        self._commit(None)
        msg = self.defaults.request_for(node, [self.text_] * node.n, stream=False)
        results = self.backend.generate(msg).results
        texts = [r["text"] for r in results]
        self._append(texts[0])  # as SGLang: the first sample continues the program
        if node.name is not None:
            self._set_var(node.name, texts, [r["meta_info"] for r in results])

    def _gen_streamed(self, msg: GenerateMsg, name: str | None) -> FinalMsg:
        received = ""
        for event in self.backend.generate_stream(msg):
            if isinstance(event, FinalMsg):
                if event.text != received:  # the final text is authoritative
                    self._set_text(self.text_[: len(self.text_) - len(received)] + event.text)
                return event
            received += event.text
            if name is not None:
                self._partial[name] = received
                self._partial_meta[name] = event.meta_info
            self._append(event.text)
        raise AssertionError("a stream ended without its final message")

    def _select(self, node: Select) -> None:
        decision = score_choices(self.backend, self.text_, list(node.choices), node.choices_method)
        choice = decision.decision
        if node.temperature > 0:
            scores = decision.meta_info.get("scores")
            if not getattr(node.choices_method, "scores_are_scalars", False) or scores is None:
                raise ProgramError(
                    f"{type(node.choices_method).__name__} supports temperature=0 only"
                )
            choice = sample_by_scores(list(node.choices), scores, node.temperature, self._rng)
        if node.name is not None:
            self._set_var(node.name, choice, decision.meta_info)
        self._append(choice)

    def _commit(self, node: Fork | None) -> None:
        if self.text_:
            self.fork_commits.append(self.backend.commit(self.text_))

    def _var_scope_end(self, node: VarScopeEnd) -> None:
        if node.name not in self._scopes:
            raise ProgramError(f"var_scope {node.name!r} ended but never began")
        self._set_var(node.name, self.text_[self._scopes.pop(node.name) :], None)

    def _unbound_arg(self, node: Arg) -> None:
        raise ProgramError(f"program argument {node.name!r} was not given")

    # -- state changes -----------------------------------------------------------------------

    def _append(self, value: str) -> None:
        self.chat.add_text(value)
        self._set_text(self.text_ + value)

    def _set_text(self, text: str) -> None:
        with self._changed:
            self.text_ = text
            self._changed.notify_all()

    def _set_var(self, name: str, value: Any, meta: Any) -> None:
        with self._changed:
            self.variables[name] = value
            self._partial.pop(name, None)
            self._partial_meta.pop(name, None)
            if meta is not None:
                self.meta_info[name] = meta
            self.set_names.append(name)
            self._changed.notify_all()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _watched(self, var_name: str | None) -> str:
        if var_name is None:
            return self.text_
        value = self.variables.get(var_name, self._partial.get(var_name, ""))
        return value if isinstance(value, str) else ""

    def _child(self) -> Executor:
        child = Executor(self.backend, self.defaults, self.stream, self.use_thread)
        child.text_ = self.text_
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.chat = self.chat.copy()
        child.error_ = self.error_
        child.fork_point = len(self.text_)
        return child


def _changed_fields(params: SamplingParams) -> dict[str, Any]:
    """The fields that differ from the defaults (max_new_tokens always): small messages."""
    default = SamplingParams()
    out = {k: v for k, v in params.to_dict().items() if v != getattr(default, k)}
    out["max_new_tokens"] = params.max_new_tokens
    return out
