"""Responses API bodies and stream events, built from the chat path's events: the answer
split as a chat answer is (`ChatPrompt.split` for the reasoning block, `ToolPlan` for tool
calls; streamed: `AnswerStream`) becomes output items — `reasoning` (the thinking block
as its summary text), `message` (output_text) and `function_call` — and a stream the
official event sequence, each event with its `sequence_number` and `event:` line."""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson

from spruce.runtime.server.http.common import ServerState, stream_error
from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan
from spruce.runtime.server.openai.chat_stream import AnswerStream, Pieces
from spruce.runtime.server.request_manager import Call, Event

if TYPE_CHECKING:
    from spruce.runtime.server.openai.responses import ResponsesRequest


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def summary_text(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


ENCRYPTED_REASONING = "reasoning.encrypted_content"
ENCRYPTED_PREFIX = "spruce:"  # this server keeps nothing: the "encrypted" content is the text


def encrypted(text: str) -> str:
    """A reasoning item's `encrypted_content` as this stateless server writes it: the
    reasoning itself (base64), so a client that sends the item back (a stateless multi-turn
    client such as Codex) hands the model its earlier thinking."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def reasoning_of(content: str | None) -> str | None:
    """The text of an `encrypted_content` this server wrote; None for any other (another
    server's is opaque here)."""
    if not content or not content.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(content[len(ENCRYPTED_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


class Item:
    """One output item while it is written: its kind ("reasoning", "message" or
    "function_call"), place, id and text so far (the arguments of a call)."""

    def __init__(self, kind: str, index: int, name: str = "", call_id: str = "") -> None:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.kind, self.index, self.id = kind, index, item_id(prefix)
        self.name, self.call_id = name, call_id
        self.text = ""

    def body(self, status: str, include: list[str] | None = None) -> dict[str, Any]:
        head = {"id": self.id, "type": self.kind, "status": status}
        if self.kind == "reasoning":
            out = {**head, "summary": [summary_text(self.text)] if self.text else []}
            if ENCRYPTED_REASONING in (include or ()):
                out["encrypted_content"] = encrypted(self.text)
            return out
        if self.kind == "message":
            return {**head, "role": "assistant", "content": [output_text(self.text)]}
        return {**head, "call_id": self.call_id, "name": self.name, "arguments": self.text}


class ResponsesView:
    """The response of one Responses request: whole (`response`) or streamed (`stream`)."""

    def __init__(
        self, server: ServerState, req: ResponsesRequest, prompt: ChatPrompt, tools: ToolPlan
    ) -> None:
        self.req, self.prompt, self.tools = req, prompt, tools
        self.tokenizer = server.model.tokenizer
        self.id = item_id("resp")
        self.created = int(time.time())
        self.sequence = 0

    def body(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        """The response object; the request's settings as the API echoes them."""
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": req.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": self._format()}, "tool_choice": self._tool_choice(),
            "tools": [{"type": "function", **t["function"]} for t in self.tools.tools],
            "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user,
            "usage": usage, **extra,
        }  # fmt: skip

    def _format(self) -> dict[str, Any]:
        fmt = self.req.text.format if self.req.text else None
        return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)

    def _tool_choice(self) -> Any:
        choice = self.req.tool_choice
        return (
            "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump()
        )

    def ending(self, e: Event, thought: bool) -> tuple[str, dict[str, Any]]:
        """(status, the body's usage and why it is incomplete or failed) of a finished
        answer; `thought`: whether it has a reasoning block. Cut by max_output_tokens:
        incomplete; aborted by the server (e.g. past its timeout_s): failed, saying why."""
        meta = e.result["meta_info"]
        prompt, output = len(self.prompt.ids), meta["completion_tokens"]
        reasoning = self.reasoning_tokens(e.result["output_ids"]) if thought else 0
        usage = {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output,
        }  # fmt: skip
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "length":
            return "incomplete", {
                "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"},
            }
        if finish.get("type") == "abort":
            error = {"code": "server_error", "message": finish.get("message") or "aborted"}
            return "failed", {"usage": usage, "error": error}
        return "completed", {"usage": usage}

    def reasoning_tokens(self, ids: list[int]) -> int:
        """The output tokens up to the reasoning block's closing tag (all of them while it
        is open): the fewest whose text holds the tag."""
        close, decode = self.prompt.reasoning.close_tag, self.tokenizer.decode
        if close not in decode(ids):
            return len(ids)
        low, high = 0, len(ids)
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if close in decode(ids[:mid]) else (mid + 1, high)
        return low

    def response(self, events: list[Event]) -> dict[str, Any]:
        """The non-streamed body of the (one) finished answer."""
        [e] = events
        reasoning, answer = self.prompt.split(e.result["text"])
        content, calls = self.tools.calls_from(answer)
        status, ending = self.ending(e, bool(reasoning))
        items = []
        if reasoning:
            items.append(_filled(Item("reasoning", 0), reasoning))
        if content or (content is not None and not calls and not reasoning):
            items.append(_filled(Item("message", 0), content))
        for call in calls:
            fn = call["function"]
            items.append(_filled(Item("function_call", 0, fn["name"], call["id"]), fn["arguments"]))
        last = len(items) - 1
        output = [
            item.body("incomplete" if i == last and status != "completed" else "completed",
                      self.req.include)
            for i, item in enumerate(items)
        ]  # fmt: skip
        return self.body(status, output, **ending)

    def event(self, kind: str, **fields) -> bytes:
        """One SSE event: its `event:` line and its data with the next sequence number."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        """The event sequence; a failure before the first event is the response's own HTTP
        status, after it an `error` event and `response.failed`."""
        answer = AnswerStream(self.prompt, self.tools, separate_reasoning=True)
        items = ItemStream(self)
        started = False
        async for e in call:
            if e.error is not None:
                stream_error(e, nothing_sent=not started)  # raises before the first event
                yield self._failed(e, items)
                return
            out = [] if started else self._start()
            started = True
            out += items.feed(answer.feed(e.text))
            if e.finished:
                out += items.feed(answer.finish())
                out += self._finish(e, items)
            if out:
                yield b"".join(out)

    def _start(self) -> list[bytes]:
        body = self.body("in_progress", [])
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]  # fmt: skip

    def _finish(self, e: Event, items: ItemStream) -> list[bytes]:
        status, ending = self.ending(e, items.thought)
        out = items.close("completed" if status == "completed" else "incomplete")
        body = self.body(status, items.done, **ending)
        return [*out, self.event(f"response.{status}", response=body)]

    def _failed(self, e: Event, items: ItemStream) -> bytes:
        error = {"code": "server_error", "message": e.error}
        out = [self.event("error", code="server_error", message=e.error, param=None)]
        out += items.close("incomplete")
        out.append(
            self.event("response.failed", response=self.body("failed", items.done, error=error))
        )
        return b"".join(out)


def _filled(item: Item, text: str) -> Item:
    item.text = text
    return item


class ItemStream:
    """A streamed answer's pieces as output item events: one item open at a time; a
    piece of another kind closes it and opens the next (added, part added, deltas, done)."""

    def __init__(self, view: ResponsesView) -> None:
        self.view = view
        self.open: Item | None = None
        self.calls: dict[int, Item] = {}  # the tool-call stream's index -> its item
        self.done: list[dict[str, Any]] = []  # finished items, in output order
        self.thought = False  # whether a reasoning item was written

    def feed(self, pieces: Pieces) -> list[bytes]:
        out = []
        if pieces.reasoning:
            self.thought = True
            out += self._text("reasoning", pieces.reasoning)
        if pieces.content:
            out += self._text("message", pieces.content)
        for delta in pieces.tool_calls:
            out += self._call(delta)
        return out

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out = [] if self.open is not None and self.open.kind == kind else self._open(Item(kind, 0))
        item, event = self.open, self.view.event
        item.text += delta
        where = {"item_id": item.id, "output_index": item.index}
        if kind == "reasoning":
            return [
                *out,
                event(
                    "response.reasoning_summary_text.delta", **where, summary_index=0, delta=delta
                ),
            ]
        return [
            *out,
            event("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[]),
        ]

    def _call(self, delta: dict[str, Any]) -> list[bytes]:
        fn, out = delta["function"], []
        if "id" in delta:  # a new call: its id and name come first
            out = self._open(Item("function_call", 0, fn["name"], delta["id"]))
            self.calls[delta["index"]] = self.open
        item, piece = self.calls[delta["index"]], fn.get("arguments") or ""
        if piece:
            item.text += piece
            out.append(self.view.event("response.function_call_arguments.delta",
                                       item_id=item.id, output_index=item.index, delta=piece))  # fmt: skip
        return out

    def _open(self, item: Item) -> list[bytes]:
        out = self.close("completed")
        item.index = len(self.done)
        self.open, event = item, self.view.event
        where = {"item_id": item.id, "output_index": item.index}
        out.append(
            event(
                "response.output_item.added", output_index=item.index, item=item.body("in_progress")
            )
        )
        if item.kind == "reasoning":
            out.append(
                event(
                    "response.reasoning_summary_part.added",
                    **where,
                    summary_index=0,
                    part=summary_text(""),
                )
            )
        elif item.kind == "message":
            out.append(
                event("response.content_part.added", **where, content_index=0, part=output_text(""))
            )
        return out

    def close(self, status: str) -> list[bytes]:
        """The open item's closing events (none open: none)."""
        item, event = self.open, self.view.event
        if item is None:
            return []
        self.open = None
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            out = [event("response.reasoning_summary_text.done", **where, summary_index=0, text=item.text),
                   event("response.reasoning_summary_part.done", **where, summary_index=0, part=summary_text(item.text))]  # fmt: skip
        elif item.kind == "message":
            out = [event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                   event("response.content_part.done", **where, content_index=0, part=output_text(item.text))]  # fmt: skip
        else:
            out = [event("response.function_call_arguments.done", **where, arguments=item.text)]
        self.done.append(item.body(status, self.view.req.include))
        out.append(event("response.output_item.done", output_index=item.index, item=self.done[-1]))
        return out
