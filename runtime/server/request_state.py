"""One request in flight, as the front end sees it (`RequestState`: the output ids the
scheduler sent, detokenized incrementally), and the `Event`s a caller reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spruce.runtime.core.request import FinishReason, Req
from spruce.runtime.core.validation import ValidRequest
from spruce.runtime.protocol.ipc import ReqUpdate
from spruce.runtime.text.detokenizer import OutputText

if TYPE_CHECKING:
    from spruce.runtime.server.request_manager import Call

LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
)


@dataclass(slots=True)
class Event:
    """One piece of news for a caller. Streaming: `text` / `output_ids` are what is new;
    otherwise (and in `result`, once finished) the whole output."""

    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    result: dict[str, Any] | None = None  # {"text", "output_ids", "meta_info"} when finished
    error: str | None = None  # the request failed: the message
    status: int = 200  # with error: an HTTP status


class RequestState:
    """One request in flight: a shadow `Req` that mirrors the scheduler's output ids, and
    its incremental text (the detokenizer)."""

    __slots__ = (
        "aborted",
        "cached",
        "call",
        "client",
        "client_rid",
        "done",
        "error",
        "index",
        "replica",
        "rid",
        "shadow",
        "stream",
        "text",
    )  # fmt: skip

    def __init__(
        self,
        rid: str,
        client_rid: str,
        index: int,
        call: Call,
        valid: ValidRequest,
        client: str = "",
    ) -> None:
        self.rid, self.client_rid, self.index, self.call, self.client = (
            rid,
            client_rid,
            index,
            call,
            client,
        )
        self.shadow = Req(rid=rid, prompt_ids=valid.input_ids, sampling=valid.sampling)
        self.text = OutputText(call.tokenizer, self.shadow)
        self.stream = valid.options.stream
        self.cached = 0
        self.replica = 0  # the scheduler replica it runs on
        self.done = False
        self.aborted = False  # the front end asked for the abort (client gone, shutdown)
        self.error: tuple[int, str] | None = (
            None  # the front end aborted it as a failure: (status, message)
        )

    def apply(self, u: ReqUpdate) -> Event:
        out = self.shadow.output_ids
        del out[u.keep :]
        out.extend(u.new_ids)
        self.cached = u.cached_tokens
        if u.finish is not None:
            self.shadow.finish_reason = FinishReason(**u.finish)
            self.done = True
            if u.finish["type"] == "abort" and self.error is not None:
                return Event(self.index, error=self.error[1], status=self.error[0])
            if u.finish["type"] == "abort" and not self.aborted:
                return self._refused(u.finish.get("message") or "the request was aborted")
        delta = self.text.update(self.shadow)
        new_ids = self.text.new_output_ids(self.shadow)
        if not self.stream:
            return self._final(Event(self.index, self.text.text, list(out)), u)
        event = Event(self.index, delta, new_ids, self._partial_meta(u))
        return self._final(event, u) if self.done else event

    def _refused(self, message: str) -> Event:
        """The scheduler aborted the request by itself (e.g. its constraint did not compile):
        an error for the caller, a 400 when nothing was generated."""
        return Event(self.index, error=message, status=400 if not self.shadow.output_ids else 500)

    def _partial_meta(self, u: ReqUpdate) -> dict[str, Any]:
        meta = {
            "id": self.client_rid,
            "prompt_tokens": len(self.shadow.prompt_ids),
            "completion_tokens": len(self.shadow.output_ids),
            "cached_tokens": self.cached,
            "finish_reason": u.finish,
        }
        if u.logprobs:
            meta.update(u.logprobs)
        return meta

    def _final(self, event: Event, u: ReqUpdate) -> Event:
        meta = dict(u.meta_info)
        meta["id"] = self.client_rid
        if self.stream:  # a chunk's logprobs are those of its own tokens
            event.meta_info = {k: v for k, v in meta.items() if k not in LOGPROB_KEYS} | (
                u.logprobs or {}
            )
        else:
            event.meta_info = meta
        event.finished = True
        event.result = {
            "text": self.text.text,
            "output_ids": list(self.shadow.output_ids),
            "meta_info": meta,
        }
        return event
