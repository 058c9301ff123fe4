"""Anthropic Messages bodies, stream events and error objects, built from the chat path's
events: the reasoning block becomes a thinking block, the answer a text block and its
tool calls tool_use blocks (the ChatPrompt / ToolPlan of the call, as ChatView reads them)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson

from spruce.runtime.server.anthropic.schemas import MessagesRequest
from spruce.runtime.server.http.common import ApiError
from spruce.runtime.server.openai.chat_stream import AnswerStream, Pieces
from spruce.runtime.server.openai.views import ChatView
from spruce.runtime.server.request_manager import Call, Event

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_object(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic sends it: its type as `event:` and in the data."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
        "input": json.loads(function["arguments"]),
    }  # fmt: skip


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(
    meta: dict[str, Any], called: bool, stops: list[str] | None
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop sequence of the request is named; a stop
    token, or a stop string of the model's own, is the end of the turn."""
    reason = meta.get("finish_reason") or {}
    if called:
        return "tool_use", None
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    if isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return "end_turn", None


class MessageView:
    """The message of one finished event (`message`), or a call's event stream (`stream`)."""

    def __init__(self, req: MessagesRequest, chat: ChatView) -> None:
        self.req = req
        self.prompt, self.tools = chat.prompt, chat.tools
        self.id = f"msg_{uuid.uuid4().hex}"

    def envelope(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
            "content": content, "stop_reason": None, "stop_sequence": None,
        }  # fmt: skip

    def usage(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
        cached = meta.get("cached_tokens", 0)
        return {
            "input_tokens": len(self.prompt.ids) - cached,
            "output_tokens": meta.get("completion_tokens", 0),
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
        }  # fmt: skip

    def message(self, e: Event) -> dict[str, Any]:
        meta = e.result["meta_info"]
        reasoning, answer = self.prompt.split(e.result["text"])
        content, calls = self.tools.calls_from(answer)
        blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        blocks += [{"type": "text", "text": content}] if content else []
        blocks += [tool_use_block(c) for c in calls]
        reason, sequence = stop_reason(meta, bool(calls), self.req.stop_sequences)
        return {
            **self.envelope(blocks), "stop_reason": reason, "stop_sequence": sequence,
            "usage": self.usage(meta),
        }  # fmt: skip

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        """message_start, content blocks (start, deltas, stop), message_delta, message_stop.
        A failure before the first event is the response's status; after it, an error event."""
        answer = AnswerStream(self.prompt, self.tools, separate_reasoning=True)
        blocks = BlockStream()
        started = False
        async for e in call:
            if e.error is not None:
                if not started:
                    raise ApiError(e.status, e.error)
                yield event("error", error_object(e.status, e.error))
                continue
            if not started:
                started = True
                message = {
                    **self.envelope([]),
                    "usage": {**self.usage(e.meta_info), "output_tokens": 0},
                }
                yield event("message_start", {"message": message})
            for chunk in blocks.feed(answer.feed(e.text)):
                yield chunk
            if e.finished:
                for chunk in blocks.feed(answer.finish()) + blocks.close():
                    yield chunk
                reason, sequence = stop_reason(
                    e.meta_info, answer.made_calls, self.req.stop_sequences
                )
                delta = {"stop_reason": reason, "stop_sequence": sequence}
                yield event("message_delta", {"delta": delta, "usage": self.usage(e.meta_info)})
                yield event("message_stop", {})


class BlockStream:
    """A streamed answer's Pieces as content block events: a block opens when the kind of
    piece changes (thinking, text, each tool call) and closes when the next opens."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Any = None  # "thinking", "text" or ("tool_use", call index)

    def feed(self, pieces: Pieces) -> list[bytes]:
        out = []
        if pieces.reasoning:
            out += self._to("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": pieces.reasoning}))
        if pieces.content:
            out += self._to("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": pieces.content}))
        for call in pieces.tool_calls:
            function = call["function"]
            if "id" in call:  # a call's first delta: its id and name
                block = {
                    "type": "tool_use",
                    "id": tool_use_id(call["id"]),
                    "name": function["name"],
                    "input": {},
                }
                out += self._to(("tool_use", call["index"]), block)
            if function.get("arguments"):
                out.append(
                    self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
                )
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _to(self, kind: Any, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.index, "delta": delta})
