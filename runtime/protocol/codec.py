"""A small typed codec for dataclass messages between processes that are both this code.

`encode` writes a dataclass (nested dataclasses, lists, tuples, dicts, scalars) as one
orjson frame. `decode_as(cls, data)` rebuilds it from the parsed JSON by the field types:
nested dataclasses become their classes, tuples tuples, and nothing is checked or
normalized again (the objects are built without calling `__init__` / `__post_init__`: the
sender built them through their constructors, behind the validation boundary).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

import orjson

Convert = Callable[[Any], Any]


def encode(msg: Any) -> bytes:
    return orjson.dumps(msg)  # orjson writes (nested, slotted) dataclasses natively


def decode_as(cls: type, data: dict[str, Any]) -> Any:
    return _builder(cls)(data)


_BUILDERS: dict[type, Convert] = {}


def _builder(cls: type) -> Convert:
    """The function that builds a `cls` from its JSON dict (made once per class)."""
    build = _BUILDERS.get(cls)
    if build is None:
        build = _BUILDERS[cls] = _make_builder(cls)
    return build


def _make_builder(cls: type) -> Convert:
    hints = typing.get_type_hints(cls)
    plan = [(f.name, _converter(hints[f.name])) for f in dataclasses.fields(cls)]
    names = {name for name, _ in plan}
    new, set_attr = object.__new__, object.__setattr__

    def build(data: dict[str, Any]) -> Any:
        assert set(data) == names, f"bad internal {cls.__name__}: {sorted(set(data) ^ names)}"
        obj = new(cls)
        for name, convert in plan:
            value = data[name]
            set_attr(obj, name, value if convert is None else convert(value))
        return obj

    return build


def _converter(hint: Any) -> Convert | None:
    """How a JSON value becomes a value of type `hint`; None: as it is."""
    if dataclasses.is_dataclass(hint):
        return _builder(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [_converter(a) for a in args if a is not type(None)]
        assert len(inner) == 1 or all(c is None for c in inner), f"ambiguous union {hint}"
        convert = inner[0]
        return None if convert is None else (lambda v: None if v is None else convert(v))
    if origin is list and args:
        item = _converter(args[0])
        return None if item is None else (lambda v: [item(x) for x in v])
    if origin is tuple:
        item = _converter(args[0]) if args else None
        return tuple if item is None else (lambda v: tuple(item(x) for x in v))
    return None
