"""JSON schema -> regex conversion with a deadline, for the front door.

Converting a schema is usually milliseconds, but a pathological one (thousands of optional
properties, `$ref`s that unroll exponentially, a huge `enum`) can take long or eat memory.
A thread cannot be stopped, so the conversion runs in a worker process of
`build_worker` (memory-capped, killed past the deadline, replaced on the next call); the
caller gets a ConstraintError naming the deadline and the other requests never wait on it.

    conversion = Conversion(whitespace_pattern="", timeout_s=30, memory_mb=4096)
    spec = conversion.spec(json_schema=..., schema_mode="lenient")   # ConstraintSpec | None
    regex = conversion.schema_regex({"type": "object", ...})

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
from dataclasses import dataclass
from typing import Any

from spruce.constrained.build_worker import ConvertRequest, WorkerPool
from spruce.constrained.json_schema import load_schema
from spruce.constrained.memory import BoundedCache, text_bytes
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
    """How a front end converts constraints: the whitespace JSON output may hold, and the
    deadline and memory cap of a JSON schema's conversion."""

    whitespace_pattern: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB

    def spec(
        self, regex: str | None = None, json_schema: Any = None, choices: list[str] | None = None,
        schema_mode: str = "lenient",
    ) -> ConstraintSpec | None:  # fmt: skip
        """The constraint (at most one) as a spec with its regex; ConstraintError if bad."""
        return shared_converter(self.memory_mb).make_spec(
            regex, json_schema, choices, self.whitespace_pattern, schema_mode, self.timeout_s
        )

    def schema_regex(self, schema: Any) -> str:
        """The regex the constrained decoder would use for a JSON schema."""
        return self.spec(json_schema=schema).regex


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
    ) -> ConstraintSpec | None:
        """As `spec.make_spec`; a JSON schema, and a regex or choices longer than
        INLINE_CHARS, are converted in a worker within `timeout_s`."""
        request = _worker_request(regex, json_schema, choices, whitespace_pattern, schema_mode)
        if request is None:
            return make_spec(regex=regex, json_schema=json_schema, choices=choices)  # checks "at most one"
        key = (request.text, request.kind, whitespace_pattern, schema_mode)
        spec = self._cache.get(key)
        if spec is None:
            with self._slots:
                spec = self._workers.run(request, timeout_s)
            size = text_bytes(request.text) + text_bytes(spec.value) + text_bytes(spec.regex)
            self._cache.put(key, spec, size)
        return spec

    def start(self, count: int = 1) -> None:
        """Starts workers ahead of the first schema (a fresh interpreter takes a moment)."""
        self._workers.start(min(count, MAX_PARALLEL))

    def close(self) -> None:
        self._workers.close()


def _worker_request(
    regex: Any, json_schema: Any, choices: Any, whitespace_pattern: str, schema_mode: str
) -> ConvertRequest | None:
    """What a worker should convert, or None when the calling thread checks it (a short
    regex or list of choices, or more than one constraint: make_spec refuses that)."""
    given = [value for value in (regex, json_schema, choices) if value is not None]
    if len(given) != 1:
        return None
    if json_schema is not None:
        return ConvertRequest("json_schema", load_schema_text(json_schema), whitespace_pattern, schema_mode)
    if isinstance(regex, str) and len(regex) > INLINE_CHARS:
        return ConvertRequest("regex", regex)
    if isinstance(choices, list) and all(isinstance(c, str) for c in choices) and sum(map(len, choices)) > INLINE_CHARS:
        return ConvertRequest("choices", json.dumps(choices, ensure_ascii=False))
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
