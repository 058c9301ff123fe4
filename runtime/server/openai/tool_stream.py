"""Tool calls out of a model's output in a given format (`tool_parsers`): whole
(`final_calls`) or streamed (`ToolCallStream`: content as it comes, each call's name once
whole, its arguments piece by piece as OpenAI's `delta.tool_calls`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from spruce.runtime.server.openai.tool_format_base import Resume
from spruce.runtime.server.openai.tool_parsers import PartialCall, Scan, ToolCallFormat


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_arguments(call: PartialCall) -> str | None:
    """The arguments as the JSON text of an object (a JSON string holding one is unwrapped),
    or None when they are not one."""
    try:
        value = json.loads(call.arguments)
        if isinstance(value, str):
            value, text = json.loads(value), value
        else:
            text = call.arguments
    except ValueError:
        return None
    return text if isinstance(value, dict) else None


def valid_calls(scan: Scan, names: set[str]) -> bool:
    if scan.broken or not scan.calls:
        return False
    return all(c.complete and c.name in names and call_arguments(c) is not None for c in scan.calls)


def final_calls(
    fmt: ToolCallFormat, text: str, names: set[str]
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, calls) of a finished output; no valid calls: (text, [])."""
    scan = fmt.scan(text, final=True)
    if not valid_calls(scan, names):
        return text, []
    calls = [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": call_arguments(c)}}
             for c in scan.calls]  # fmt: skip
    return scan.content or None, calls


# A stream scans from where the last scan said it may begin again (`Scan.resume`): the text
# before holds no call that can still change. Inside a call (or in a format that never says)
# the text to scan grows; past this many characters it is scanned again only once it grew by
# an eighth, so a long call costs linear work too (its deltas come in pieces of an eighth).
SCAN_EVERY_DELTA_CHARS = 4096


class ToolCallStream:
    """`feed(delta)` -> (content delta, tool-call deltas); `finish()` the same for what is
    left. A call's first delta carries its index, id, type and name; the next ones pieces
    of its arguments. A call to an unknown function, or output that turns out not to be
    calls, ends in content: everything not yet sent. The deltas join into what a scan of the
    whole output gives, with work linear in the output (`scanned` counts what it read)."""

    def __init__(self, fmt: ToolCallFormat, names: set[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.pieces: list[str] = []  # the output so far
        self.tail = ""  # the output from the resume point on, read by `reader`
        self.unscanned: list[str] = []  # deltas not in the tail yet (not scanned)
        self.unscanned_len = 0
        self.reader = fmt
        self.before = _Before()
        self.scanned = 0  # characters the scans read
        self.sent_content = 0
        self.sent_arguments: list[int] = []  # per call started
        self.failed = False

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_arguments)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.pieces.append(delta)
        if self.failed:
            return "", []
        self.unscanned.append(delta)
        self.unscanned_len += len(delta)
        if not self._due():
            return "", []
        self.tail += "".join(self.unscanned)
        self.unscanned, self.unscanned_len = [], 0
        scan = self.reader.scan(self.tail, final=False)
        self.scanned += len(self.tail)
        out = self._tail_content(scan.content), self._call_deltas(self.before.calls + scan.calls)
        self._resume(scan.resume, scan.calls)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text = self.text
        scan = self.fmt.scan(text, final=True)
        self.scanned += len(text)
        if self.failed or not valid_calls(scan, self.names):
            self.failed = True  # e.g. cut by max_tokens: what was sent of a call stays sent
            rest = text[self.sent_content :] if not self.has_calls else ""
            return rest, []
        return self._content(scan.content, text), self._call_deltas(scan.calls)

    def _due(self) -> bool:
        size = len(self.tail) + self.unscanned_len
        return size <= SCAN_EVERY_DELTA_CHARS or self.unscanned_len >= size // 8

    def _resume(self, resume: Resume | None, calls: list[PartialCall]) -> None:
        """Moves the tail's start to where the scan said the next may begin."""
        if resume is None or not (resume.at or resume.reader):
            return
        if self.before.content_grows and resume.content:
            self.before.content += resume.at
        self.before.content_grows = self.before.content_grows and resume.content
        self.before.calls += calls[: resume.calls]
        self.tail = self.tail[resume.at :]
        self.reader = resume.reader or self.reader

    def _tail_content(self, content: str) -> str:
        """The new content of a streamed scan of the tail."""
        if not self.before.content_grows:
            return ""
        out = content[max(0, self.sent_content - self.before.content) :]
        self.sent_content = max(self.sent_content, self.before.content + len(content))
        return out

    def _content(self, content: str, text: str) -> str:
        if self.has_calls and not content.startswith(text[: self.sent_content]):
            return ""  # final content was tidied (stripped): what was sent stays
        out = content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(content))
        return out

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if call.name not in self.names:
                self.failed = True
                break
            out += self._deltas_of(index, call)
        return out

    def _deltas_of(self, index: int, call: PartialCall) -> list[dict[str, Any]]:
        if index == len(self.sent_arguments):
            self.sent_arguments.append(len(call.arguments))
            head = {"index": index, "id": new_call_id(), "type": "function"}
            return [{**head, "function": {"name": call.name, "arguments": call.arguments}}]
        piece = call.arguments[self.sent_arguments[index] :]
        self.sent_arguments[index] = len(call.arguments)
        return [{"index": index, "function": {"arguments": piece}}] if piece else []


@dataclass(slots=True)
class _Before:
    """What a stream's scans found before its tail: the calls (whole), the content's length,
    and whether the content still grows (the text before the tail is all content)."""

    calls: list[PartialCall] = field(default_factory=list)
    content: int = 0
    content_grows: bool = True
