"""The front door's JSON schema conversion: in a worker process, stopped at its deadline."""

from __future__ import annotations

import threading
import time

import pytest

from spruce.constrained.convert import Conversion, SpecConverter
from spruce.constrained.core.errors import ConstraintError
from spruce.constrained.spec import make_spec

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name"],
}
# optional properties: 600 take ~0.2 s to convert, 12000 several seconds
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12000)}}


@pytest.fixture
def converter():
    converter = SpecConverter(memory_mb=2048)
    yield converter
    converter.close()


def test_worker_result_equals_in_process_conversion(converter):
    got = converter.make_spec(
        backend="spruce", json_schema=SCHEMA, whitespace_pattern="[ ]?", schema_mode="strict"
    )
    want = make_spec(
        backend="spruce", json_schema=SCHEMA, whitespace_pattern="[ ]?", schema_mode="strict"
    )
    assert (got, got.regex, got.unenforced) == (want, want.regex, want.unenforced)
    assert (
        converter.make_spec(
            backend="spruce", json_schema=SCHEMA, whitespace_pattern="[ ]?", schema_mode="strict"
        )
        is got
    )  # cached


def test_errors_come_back_as_constraint_errors(converter):
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}
    with pytest.raises(ConstraintError, match="'pattern' at #/properties/a"):
        converter.make_spec(backend="spruce", json_schema=bad, schema_mode="strict")
    with pytest.raises(ConstraintError, match="at most one constraint"):
        converter.make_spec(regex="a", json_schema=SCHEMA)
    assert converter.make_spec(regex="a+").regex == "a+"  # regexes convert in the caller
    assert converter.make_spec() is None


def test_conversion_past_its_deadline_is_stopped_and_the_next_one_works(converter):
    converter.start()
    converter.make_spec(backend="spruce", json_schema=SCHEMA)  # the worker is up
    start = time.monotonic()
    with pytest.raises(ConstraintError, match="not converted within 0.01 s"):
        converter.make_spec(backend="spruce", json_schema=WIDE, timeout_s=0.01)
    assert time.monotonic() - start < 5
    # the killed worker is replaced; the same schema converts given time, other schemas too
    assert converter.make_spec(backend="spruce", json_schema=WIDE, timeout_s=60).regex.startswith(
        r"\{"
    )
    assert converter.make_spec(backend="spruce", json_schema={"type": "integer"}).regex


def test_a_slow_conversion_does_not_hold_up_a_quick_one(converter):
    converter.start(2)
    slow_done = threading.Event()

    def slow():
        try:
            converter.make_spec(backend="spruce", json_schema=SLOW, timeout_s=120)
        finally:
            slow_done.set()

    threading.Thread(target=slow).start()
    time.sleep(0.2)
    assert (
        converter.make_spec(backend="spruce", json_schema={"type": "boolean"}).regex
        == "(?:true|false)"
    )
    assert not slow_done.is_set()  # the quick one came back while the slow one still runs
    assert slow_done.wait(120)


def test_conversion_carries_whitespace_and_deadline():
    conversion = Conversion(whitespace_pattern="[ ]?", timeout_s=0.001)
    with pytest.raises(ConstraintError, match="not converted within"):
        conversion.spec(json_schema={**WIDE, "title": "not cached yet"})
    assert (
        Conversion(whitespace_pattern="[ ]?").schema_regex(SCHEMA)
        == make_spec(json_schema=SCHEMA, whitespace_pattern="[ ]?", backend="spruce").regex
    )
