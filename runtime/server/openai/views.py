"""OpenAI response bodies and stream chunks, built from the request manager's events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from spruce.constrained.spec import ConstraintSpec
from spruce.runtime.server.http.common import SSE_DONE, ServerState, sse, stream_error
from spruce.runtime.server.openai.chat_prompt import ChatPrompt, ToolPlan, answer_report
from spruce.runtime.server.openai.chat_stream import AnswerStream
from spruce.runtime.server.openai.schemas import ChatRequest, CompletionRequest, SamplingRequest
from spruce.runtime.server.request_manager import Call, Event


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return None if reason is None else reason["type"]


def schema_report(meta: dict[str, Any]) -> dict[str, Any]:
    """Extension field `json_schema` of a JSON-schema choice: the keywords its grammar did not
    enforce and whether the output validated (see spruce.constrained.report)."""
    return {"json_schema": meta["json_schema"]} if "json_schema" in meta else {}


def matched_stop(meta: dict[str, Any]) -> Any:
    reason = meta.get("finish_reason")
    return None if reason is None else reason.get("matched")


class _View:
    """Shared pieces of the completions and chat response builders."""

    response_object: str  # the OpenAI "object" of a whole (non-streamed) response

    def __init__(
        self, server: ServerState, req: SamplingRequest, prefix: str, prompt_lens: list[int]
    ) -> None:
        self.req = req
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.tokens = TokenText(server.model)
        self.prompt_lens = prompt_lens
        self.done: dict[int, Event] = {}  # finished events by choice index (for stream usage)

    def envelope(self, choices: list[dict], object_name: str) -> dict[str, Any]:
        return {
            "id": self.id, "object": object_name, "created": self.created, "model": self.req.model,
            "choices": choices,
        }  # fmt: skip

    def usage(self) -> dict[str, Any]:
        """Prompt tokens count once per prompt (not per choice); cached: its first choice's."""
        metas = {i: e.result["meta_info"] for i, e in self.done.items()}
        n = self.req.n
        cached = sum(
            metas[p * n]["cached_tokens"] for p in range(len(self.prompt_lens)) if p * n in metas
        )
        completion = sum(m["completion_tokens"] for m in metas.values())
        return usage(sum(self.prompt_lens), completion, cached)

    def stream_end(self, object_name: str) -> list[bytes]:
        """The last events of a stream: the usage chunk when asked for, then [DONE]."""
        end = [SSE_DONE]
        if self.req.stream_options and self.req.stream_options.include_usage:
            end.insert(0, sse({**self.envelope([], object_name), "usage": self.usage()}))
        return end

    @staticmethod
    def stream_error(e: Event, nothing_sent: bool) -> bytes:
        """Before the first chunk an error is a proper HTTP status; after it, an error event."""
        return stream_error(e, nothing_sent, e.error, with_index=False)

    def finished(self, events: list[Event]) -> None:
        self.done.update((e.index, e) for e in events)

    def response(self, events: list[Event]) -> dict[str, Any]:
        """The non-streaming body: one choice per event (`_choice`) and the usage."""
        self.finished(events)
        body = self.envelope([self._choice(e) for e in events], self.response_object)
        body["usage"] = self.usage()
        return body


class CompletionView(_View):
    response_object = "text_completion"

    def __init__(
        self, server: ServerState, req: CompletionRequest, prompts: list[list[int]], top: int
    ) -> None:
        super().__init__(server, req, "cmpl", [len(p) for p in prompts])
        self.top = top
        self.echo_texts = [server.model.tokenizer.decode(p) for p in prompts] if req.echo else None

    def _choice(self, e: Event) -> dict[str, Any]:
        meta = e.result["meta_info"]
        return {
            "index": e.index,
            "text": self._echo(e.index) + e.result["text"],
            "logprobs": self._logprobs(meta) if self.req.logprobs is not None else None,
            "finish_reason": finish_reason(meta),
            "matched_stop": matched_stop(meta),
            **schema_report(meta),
        }

    def _echo(self, index: int) -> str:
        return "" if self.echo_texts is None else self.echo_texts[index // self.req.n]

    def _logprobs(self, meta: dict[str, Any], offset: int = 0) -> dict[str, Any]:
        entries = list(meta.get("output_token_logprobs") or [])
        tops = list(meta.get("output_top_logprobs") or [None] * len(entries))
        if self.req.echo and "input_token_logprobs" in meta:
            inputs = list(meta["input_token_logprobs"])
            entries = inputs + entries
            tops = list(meta.get("input_top_logprobs") or [None] * len(inputs)) + tops
        return self.tokens.completion_logprobs(entries, tops, offset)

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        offsets: dict[int, int] = {}
        async for e in call:
            if e.error is not None:
                yield self.stream_error(e, nothing_sent=not offsets and not self.done)
                continue
            text = e.text if e.index in offsets else self._echo(e.index) + e.text
            offset = offsets.get(e.index, 0)
            choice = {
                "index": e.index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason(e.meta_info),
            }
            if self.req.logprobs is not None:
                choice["logprobs"] = self._logprobs(e.meta_info, offset)
            offsets[e.index] = offset + len(text)
            yield sse(self.envelope([choice], "text_completion"))
            if e.finished:
                self.finished([e])
        for chunk in self.stream_end("text_completion"):
            yield chunk


class ChatView(_View):
    response_object = "chat.completion"

    def __init__(
        self, server: ServerState, req: ChatRequest, prompt: ChatPrompt, tools: ToolPlan,
        answer_spec: ConstraintSpec | None = None,
    ) -> None:  # fmt: skip
        super().__init__(server, req, "chatcmpl", [len(prompt.ids)])
        self.prompt = prompt
        self.tools = tools
        self.answer_spec = (
            answer_spec  # a constraint wrapped after a reasoning block (ChatPrompt.constrain)
        )

    def _choice(self, e: Event) -> dict[str, Any]:
        meta = e.result["meta_info"]
        reasoning, answer = self._split(e.result["text"])
        content, calls = self.tools.calls_from(answer)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        reason = finish_reason(meta)
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls"
        return {
            "index": e.index,
            "message": message,
            "logprobs": self._logprobs(meta) if self.req.logprobs else None,
            "finish_reason": reason,
            "matched_stop": matched_stop(meta),
            **schema_report(meta),
            **answer_report(self.answer_spec, self.prompt.split(e.result["text"])[1]),
        }

    def _split(self, text: str) -> tuple[str | None, str]:
        return self.prompt.split(text) if self.req.separate_reasoning else (None, text)

    def _logprobs(self, meta: dict[str, Any]) -> dict[str, Any]:
        entries = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(entries)
        return {"content": self.tokens.chat_logprobs(entries, tops)}

    async def stream(self, call: Call) -> AsyncIterator[bytes]:
        answers = {
            i: AnswerStream(self.prompt, self.tools, self.req.separate_reasoning)
            for i in range(self.req.n)
        }
        started: set[int] = set()
        async for e in call:
            if e.error is not None:
                yield self.stream_error(e, nothing_sent=not started)
                continue
            if e.index not in started:
                started.add(e.index)
                yield self._chunk(e.index, {"role": "assistant", "content": ""}, None)
            for chunk in self._event_chunks(e, answers[e.index]):
                yield chunk
            if e.finished:
                self.finished([e])
        for chunk in self.stream_end("chat.completion.chunk"):
            yield chunk

    def _event_chunks(self, e: Event, answer: AnswerStream) -> list[bytes]:
        out = []
        delta = answer.feed(e.text).delta()
        logprobs = self._logprobs(e.meta_info) if self.req.logprobs else None
        if delta or (logprobs and logprobs["content"]):
            out.append(self._chunk(e.index, delta or {"content": ""}, None, logprobs))
        if e.finished:
            rest = answer.finish().delta()
            if rest:
                out.append(self._chunk(e.index, rest, None))
            reason = "tool_calls" if answer.made_calls else finish_reason(e.meta_info)
            out.append(self._chunk(e.index, {}, reason))
        return out

    def _chunk(
        self, index: int, delta: dict, reason: str | None, logprobs: dict | None = None
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse(self.envelope([choice], "chat.completion.chunk"))


class TokenText:
    """Token strings and bytes for the logprobs shapes: a token that is not whole UTF-8 by
    itself is written "bytes:\\xNN..." (as OpenAI does); `bytes` are always the raw bytes."""

    def __init__(self, model) -> None:
        self.model = model

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        raw = self.model.token_bytes[token] if token < len(self.model.token_bytes) else b""
        return {"token": _token_string(raw), "logprob": logprob, "bytes": list(raw)}

    def chat_logprobs(self, entries: list, tops: list) -> list[dict[str, Any]]:
        return [
            {
                **self._entry(token, logprob),
                "top_logprobs": [self._entry(t, lp) for lp, t in (top or [])],
            }
            for (logprob, token), top in zip(entries, tops)
        ]

    def completion_logprobs(self, entries: list, tops: list, offset: int = 0) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for (logprob, token), top in zip(entries, tops):
            text = self._entry(token, logprob)["token"]
            tokens.append(text)
            token_logprobs.append(logprob)
            top_logprobs.append({self._entry(t, lp)["token"]: lp for lp, t in top} if top else None)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }  # fmt: skip


def _token_string(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
