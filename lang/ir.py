"""The program IR: typed, immutable nodes that a program appends to its state.

`s += "text"` appends a `Text`, `s += sl.gen("x")` a `Gen`, and so on. The interpreter
executes the nodes one by one; `prog.trace()` returns them without running anything.
Nodes concatenate with `+` (and with strings) into a `Seq`, which is flattened on append.

The sampling keywords of `gen` / `run` are not listed here: they are derived from
`SamplingParams` and `RequestOptions` (the one definitions).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spruce.lang.errors import ProgramError
from spruce.runtime.core.options import RequestOptions
from spruce.runtime.core.sampling_params import SamplingParams

# SGLang's module-level regexes for typed gens, spelled our way with the same language:
# an optionally signed integer / decimal (trailing spaces and newlines allowed), a Python
# bool, a double-quoted string of word and space characters.
REGEX_INT = r"[+-]?[0-9]+[\n ]*"
REGEX_FLOAT = r"[+-]?[0-9]*\.?[0-9]+[\n ]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = (
    r'"[\w\s]*"'  # SGLang's: admits raw newlines / tabs; gen(dtype=str) writes a JSON string
)

# SGLang's gen() names that differ from SamplingParams' field names.
DSL_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
SAMPLING_FIELDS = SamplingParams.field_names()
# The request options a program may set (logprobs, timeout_s): RequestOptions' fields but
# stream, which is the run's (`run(stream=True)`).
REQUEST_OPTIONS = tuple(name for name in RequestOptions.field_names() if name != "stream")

Params = tuple[tuple[str, Any], ...]  # (name, value) pairs: immutable


@dataclass(frozen=True, slots=True)
class Node:
    """Base of every IR node."""

    def __add__(self, other: Any) -> Seq:
        return Seq((*_parts(self), *_parts(other)))

    def __radd__(self, other: Any) -> Seq:
        return Seq((*_parts(other), *_parts(self)))


@dataclass(frozen=True, slots=True)
class Text(Node):
    value: str


@dataclass(frozen=True, slots=True)
class Gen(Node):
    """Generate text into variable `name`. `sampling` holds only the fields the program
    set (SamplingParams names, normalized); unset ones come from the run's defaults."""

    name: str | None
    sampling: Params = ()
    options: Params = ()  # return_logprob, logprob_start_len, top_logprobs_num
    dtype: str | None = None  # int | float | bool | str (already turned into `sampling`'s regex)
    n: int = 1  # samples in one request; n > 1 sets the variable to a list of n texts
    reasoning: str | None = (
        None  # a REASONING_FORMATS name: the variable gets the answer, <name>_reasoning_content the rest
    )

    @property
    def sampling_params(self) -> dict[str, Any]:
        return dict(self.sampling)

    @property
    def request_options(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True, slots=True)
class Select(Node):
    """Pick one of `choices` by scoring each with prompt logprobs (see spruce.lang.choices)."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    choices_method: Any  # a ChoicesMethod (frozen, hashable)


@dataclass(frozen=True, slots=True)
class RoleBegin(Node):
    role: str


@dataclass(frozen=True, slots=True)
class RoleEnd(Node):
    role: str


@dataclass(frozen=True, slots=True)
class VarScopeBegin(Node):
    name: str


@dataclass(frozen=True, slots=True)
class VarScopeEnd(Node):
    name: str


@dataclass(frozen=True, slots=True)
class Fork(Node):
    """`s.fork(size)`: the parent's text is committed, then `size` children continue from it.
    In a trace, `branches` holds each child's nodes."""

    size: int
    branches: tuple[tuple[Node, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Join(Node):
    mode: str = "gather_variable"


@dataclass(frozen=True, slots=True)
class Arg(Node):
    """A program argument that a trace left unbound; str() gives "{name}"."""

    name: str

    def __str__(self) -> str:
        return "{" + self.name + "}"


@dataclass(frozen=True, slots=True)
class Var(Node):
    """The value of variable `name` (what `s[name]` gives in a trace); appended, it is the
    variable's text."""

    name: str

    def __str__(self) -> str:
        return "{" + self.name + "}"


@dataclass(frozen=True, slots=True)
class Seq(Node):
    """Several nodes appended in order (from `a + b`, `sl.user(...)`)."""

    nodes: tuple[Node, ...]


def to_node(value: Any) -> Node:
    """What a program may append: a string, a node, or a list / tuple of those."""
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (list, tuple)):
        return Seq(tuple(to_node(v) for v in value))
    raise ProgramError(
        f"cannot append a {type(value).__name__} to a program state; append a string or a "
        "DSL expression (sl.gen, sl.select, a role, ...); use str(value) for other values"
    )


def flatten(node: Node) -> Iterable[Node]:
    if isinstance(node, Seq):
        for part in node.nodes:
            yield from flatten(part)
    else:
        yield node


def _parts(value: Any) -> tuple[Node, ...]:
    node = to_node(value)
    return node.nodes if isinstance(node, Seq) else (node,)


# -- sampling keywords ---------------------------------------------------------------------


def dsl_keywords() -> tuple[str, ...]:
    """Every sampling / request keyword gen() and run() accept, in SamplingParams order,
    with SGLang's names (max_tokens, min_tokens)."""
    renamed = {v: k for k, v in DSL_NAMES.items()}
    return tuple(renamed.get(name, name) for name in SAMPLING_FIELDS) + REQUEST_OPTIONS


def split_params(params: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """DSL keywords -> (SamplingParams fields, request options), None values dropped and
    values normalized (lists to tuples, a schema dict or pydantic model to JSON text)."""
    sampling, options = {}, {}
    for key, value in params.items():
        if value is None:
            continue
        name = DSL_NAMES.get(key, key)
        if name in SAMPLING_FIELDS:
            sampling[name] = value
        elif name in REQUEST_OPTIONS:
            options[name] = value
        else:
            raise TypeError(
                f"{where}() got an unexpected keyword argument {key!r}; "
                f"sampling keywords: {', '.join(dsl_keywords())}"
            )
    if sampling:  # in SamplingParams order: equal settings give equal nodes
        normalized = SamplingParams().replace(**sampling)
        sampling = {name: getattr(normalized, name) for name in SAMPLING_FIELDS if name in sampling}
    return sampling, options
