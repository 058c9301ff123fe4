"""JSON schema -> regex conversion with a deadline, for the front door.

Converting a schema is usually milliseconds, but a pathological one (thousands of optional
properties, `$ref`s that unroll exponentially, a huge `enum`) can take long or eat memory.
A thread cannot be stopped, so the conversion runs in a worker process of
`build_worker` (memory-capped, killed past the deadline, replaced on the next call); the
caller gets a ConstraintError naming the deadline and the other requests never wait on it.

    conversion = Conversion(whitespace_pattern="", timeout_s=30, memory_mb=4096, backend="auto")
    spec = conversion.spec(json_schema=..., schema_mode="lenient")   # ConstraintSpec | None
    spec = conversion.spec(ebnf='root ::= "yes" | "no"')            # lark=, structural_tag= too
    regex = conversion.schema_regex({"type": "object", ...})        # the spruce converter's

Grammars (ebnf, lark, structural tags) are converted and checked in a worker too.
Short regexes, choices and dtypes are checked in the calling thread (`spec.make_spec`):
linear in their size, microseconds. Longer ones (past INLINE_CHARS) go to a worker as
schemas do: linear still, but a 200k-character class is ~0.7 s of Python that would hold
the front end's interpreter. What workers convert is kept in a small LRU bounded in bytes
(keyed by the text and the options), so a client sending the same constraint again pays
one dictionary lookup.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace
from typing import Any

from spruce.constrained.backends import GRAMMAR_KINDS
from spruce.constrained.build_worker import ConvertRequest, WorkerPool
from spruce.constrained.core.memory import BoundedCache, text_bytes
from spruce.constrained.schema.json_schema import load_schema
from spruce.constrained.spec import ConstraintSpec, make_spec

DEFAULT_TIMEOUT_S = 30.0  # the grammar timeout's default (--grammar-timeout-s)
DEFAULT_MEMORY_MB = 4096  # the grammar workers' default memory cap (--grammar-memory-mb)
MAX_PARALLEL = 2  # conversions at once (each in its own worker); the others wait their turn
CACHE_BYTES = 32 * 2**20  # converted schemas kept: regex + schema text, roughly
# A regex or choices longer than this is parsed in a worker too: parsing is linear, but a
# 200k-character class keeps the interpreter ~0.7 s, which the front end's loop would wait out.
INLINE_CHARS = 4096


@dataclass(frozen=True, slots=True)
class Conversion:
    """How a front end converts constraints: the whitespace JSON output may hold, the
    deadline and memory cap of a conversion, and the grammar backend (`--grammar-backend`)."""

    whitespace_pattern: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB
    backend: str = "auto"

    def spec(
        self, regex: str | None = None, json_schema: Any = None, choices: list[str] | None = None,
        schema_mode: str = "lenient", *, ebnf: str | None = None, lark: str | None = None,
        structural_tag: Any = None, check: bool = False,
    ) -> ConstraintSpec | None:  # fmt: skip
        """The constraint (at most one) as a spec; ConstraintError if bad. `check`: as
        make_spec's (decide the backend here, for a spec embedded in a larger grammar)."""
        return shared_converter(self.memory_mb).make_spec(
            regex, json_schema, choices, self.whitespace_pattern, schema_mode, self.timeout_s,
            ebnf=ebnf, lark=lark, structural_tag=structural_tag, backend=self.backend, check=check,
        )  # fmt: skip

    def schema_regex(self, schema: Any) -> str:
        """The regex of a JSON schema by the spruce converter (to embed in a larger regex)."""
        return replace(self, backend="spruce").spec(json_schema=schema).regex


class SpecConverter:
    """`make_spec` whose JSON schema conversions run in killable worker processes. Thread-safe."""

    def __init__(self, memory_mb: int, cache_bytes: int = CACHE_BYTES) -> None:
        self._workers = WorkerPool(memory_mb, MAX_PARALLEL)
        self._slots = threading.BoundedSemaphore(MAX_PARALLEL)
        self._cache = BoundedCache(cache_bytes)

    def make_spec(
        self,
        regex: str | None = None,
        json_schema: Any = None,
        choices: list[str] | None = None,
        whitespace_pattern: str = "",
        schema_mode: str = "lenient",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        ebnf: str | None = None,
        lark: str | None = None,
        structural_tag: Any = None,
        backend: str = "auto",
        check: bool = False,
    ) -> ConstraintSpec | None:
        """As `spec.make_spec`; a JSON schema, a grammar, and a regex or choices longer than
        INLINE_CHARS are converted in a worker within `timeout_s`."""
        given = {"regex": regex, "json_schema": json_schema, "choices": choices, "ebnf": ebnf, "lark": lark,
                 "structural_tag": structural_tag}  # fmt: skip
        given = {name: value for name, value in given.items() if value is not None}
        request = _worker_request(given, whitespace_pattern, schema_mode, backend, check)
        if request is None:
            return make_spec(**given, backend=backend)  # checks "at most one"
        key = (request.text, request.kind, whitespace_pattern, schema_mode, backend, check)
        spec = self._cache.get(key)
        if spec is None:
            with self._slots:
                spec = self._workers.run(request, timeout_s)
            size = sum(text_bytes(t) for t in (request.text, spec.value, spec.regex, spec.grammar))
            self._cache.put(key, spec, size)
        return spec

    def start(self, count: int = 1) -> None:
        """Starts workers ahead of the first schema (a fresh interpreter takes a moment)."""
        self._workers.start(min(count, MAX_PARALLEL))

    def close(self) -> None:
        self._workers.close()


def _worker_request(
    given: dict[str, Any], whitespace_pattern: str, schema_mode: str, backend: str, check: bool
) -> ConvertRequest | None:
    """What a worker should convert, or None when the calling thread checks it (a short
    regex or list of choices, or more than one constraint: make_spec refuses that)."""
    if len(given) != 1:
        return None
    ((kind, value),) = given.items()
    if kind == "json_schema":
        return ConvertRequest(
            kind, load_schema_text(value), whitespace_pattern, schema_mode, backend, check
        )
    if kind in GRAMMAR_KINDS and isinstance(value, (str, dict)):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return ConvertRequest(kind, text, backend=backend)
    if kind == "regex" and isinstance(value, str) and len(value) > INLINE_CHARS:
        return ConvertRequest(kind, value, backend=backend)
    if (
        kind == "choices"
        and isinstance(value, list)
        and all(isinstance(c, str) for c in value)
        and sum(map(len, value)) > INLINE_CHARS
    ):
        return ConvertRequest(kind, json.dumps(value, ensure_ascii=False), backend=backend)
    return None


def load_schema_text(json_schema: Any) -> str:
    """The schema as JSON text (a dict, JSON text or a pydantic model class); ConstraintError
    for anything that is not a schema. Parsing is linear: the caller's thread does it."""
    return json.dumps(load_schema(json_schema), ensure_ascii=False)


_shared: dict[int, SpecConverter] = {}
_shared_lock = threading.Lock()


def shared_converter(memory_mb: int) -> SpecConverter:
    """One converter per process (per memory cap): every front end in the process shares
    its workers and its cache."""
    with _shared_lock:
        converter = _shared.get(memory_mb)
        if converter is None:
            converter = _shared[memory_mb] = SpecConverter(memory_mb)
        return converter
