"""Reading JSON that may still be arriving: where a value ends (None: not yet), and the
members of a top-level object so far. Tool-call parsers use it to stream a call's name as
soon as it is whole and its arguments piece by piece."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_WHITESPACE = " \t\r\n"
_CLOSERS = {"{": "}", "[": "]"}


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int, final: bool = False) -> int | None:
    """The index just past the JSON value at `start` (no leading whitespace), or None when
    the text ends before it does. A bare number at the end counts as whole only if `final`."""
    if start >= len(text):
        return None
    if text[start] == '"':
        return _string_end(text, start)
    if text[start] in _CLOSERS:
        return _container_end(text, start)
    i = start
    while i < len(text) and text[i] not in _WHITESPACE + ",}]":
        i += 1
    return i if i < len(text) or final else None


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def _container_end(text: str, start: int) -> int | None:
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@dataclass(slots=True)
class Member:
    """One member of an object: its key and value span (`end` None: still arriving)."""

    key: str
    start: int
    end: int | None


def object_members(text: str, start: int) -> tuple[list[Member], int | None]:
    """(members so far, index past the closing brace or None) of the object at `start`.
    Stops at the first member whose key is not whole yet; text that is not an object's
    syntax stops the scan too (the caller decides once the text is final)."""
    members: list[Member] = []
    i = skip_space(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = skip_space(text, i + 1)
            continue
        key_end = _string_end(text, i) if text[i] == '"' else None
        if key_end is None:
            break
        colon = skip_space(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            break
        value_start = skip_space(text, colon + 1)
        if value_start >= len(text):
            break
        end = value_end(text, value_start)
        members.append(Member(json.loads(text[i:key_end]), value_start, end))
        if end is None:
            break
        i = skip_space(text, end)
    return members, None


def loads_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
